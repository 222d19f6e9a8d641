use super::*;

fn result(prompt: usize, acceptance: Vec<u32>, same: bool) -> PromptResult {
    let n: u32 = acceptance.iter().sum::<u32>() + 1;
    let output: Vec<u32> = (0..n).collect();
    PromptResult {
        prompt,
        baseline_ids: Some(if same {
            output.clone()
        } else {
            vec![9; n as usize]
        }),
        output_ids: output,
        acceptance,
        speculative_seconds: f64::from(n) * 0.01,
        baseline_seconds: Some(f64::from(n) * 0.03),
    }
}

fn request(prompts: Vec<Vec<u32>>, block_size: usize) -> EvalRequest {
    EvalRequest {
        version: EVAL_VERSION,
        target_model: PathBuf::from("t"),
        drafter: PathBuf::from("d"),
        block_size,
        prompts,
        max_new_tokens: 8,
        stop_token_ids: Vec::new(),
        dtype: Precision::F32,
        baseline: true,
        init_seed: None,
        torch: None,
        sampling: None,
    }
}

/// τ is the mean over prompts of each prompt's mean gain per step, not the pooled mean.
#[test]
fn tau_is_the_mean_of_the_per_prompt_means() {
    // Prompt 0: steps gaining 4, 4, 1 (mean 3); prompt 1: 1, 1, 1, 1, 1, 1 (mean 1).
    let results = vec![result(0, vec![4, 4, 1], true), result(1, vec![1; 6], true)];
    let s = summarize(
        &results,
        &[3, 7],
        &request(vec![vec![1; 10], vec![2; 20]], 4),
        "cpu".into(),
    );
    assert_eq!(s.tau, 2.0);
    assert_eq!(s.pooled_tau, 15.0 / 9.0);
    assert_eq!(s.histogram, vec![7.0 / 9.0, 0.0, 0.0, 2.0 / 9.0]);
    assert!((s.speedup - 3.0).abs() < 1e-12);
    assert!((s.baseline_seconds_per_token / s.speculative_seconds_per_token - 3.0).abs() < 1e-12);
    assert_eq!(s.lossless, Some(true));
    assert_eq!(s.tokens, 10 + 7);
    let per = &s.per_prompt;
    assert_eq!(per[0].line, 3);
    assert_eq!(
        (per[1].tau, per[1].steps, per[1].prompt_tokens),
        (1.0, 6, 20)
    );
    // An output that differs from greedy decoding is named.
    let two = request(vec![vec![1], vec![1]], 4);
    let results = vec![result(0, vec![2], true), result(1, vec![3], false)];
    let s = summarize(&results, &[1, 2], &two, "cpu".into());
    assert_eq!(s.lossless, Some(false));
    assert_eq!(
        (s.per_prompt[0].lossless, s.per_prompt[1].lossless),
        (Some(true), Some(false))
    );
    // Sampled outputs are not compared with the target's: lossless is not claimed either way.
    let sampled = EvalRequest {
        sampling: Some(dflash_common::eval::Sampling {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }),
        ..two.clone()
    };
    let s = summarize(&results, &[1, 2], &sampled, "cpu".into());
    assert_eq!(s.lossless, None);
    assert!(s.per_prompt.iter().all(|p| p.lossless.is_none()));
    assert!(
        render(&s).contains("lossless: in distribution"),
        "{}",
        render(&s)
    );
    // A prompt whose first token stopped it has no steps and no τ of its own.
    let results = vec![result(0, vec![], true), result(1, vec![3, 1], true)];
    let s = summarize(&results, &[1, 2], &two, "cpu".into());
    assert_eq!((s.tau, s.pooled_tau), (2.0, 2.0));
}

#[test]
fn bad_prompt_files_name_the_line() {
    let dir = std::env::temp_dir().join(format!("dflash-eval-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("prompts.jsonl");
    let tok = dir.join("missing-tokenizer.json");
    for (text, want) in [
        ("{\"input_ids\": [1, 2]}\nnot json\n", ":2: not JSON"),
        ("{\"input_ids\": []}\n", ":1: the prompt has no tokens"),
        ("\n{\"text\": \"hi\"}\n", ":2: neither input_ids"),
        ("{\"input_ids\": [1, -2]}\n", ":1:"),
        ("\n\n", "no prompts"),
        (
            "{\"conversations\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
            "missing-tokenizer.json",
        ),
    ] {
        std::fs::write(&path, text).unwrap();
        let err = read_prompts(&path, Template::ChatMl, &tok, None).unwrap_err();
        assert!(err.contains(want), "{text:?}: {err}");
    }
    std::fs::write(&path, "{\"input_ids\": [1]}\n{\"input_ids\": [2, 3]}\n").unwrap();
    let got = read_prompts(&path, Template::ChatMl, &tok, Some(1)).unwrap();
    assert_eq!(got, vec![(1, vec![1])]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn prompts_past_the_context_or_the_vocabulary_are_refused() {
    let target: Qwen3Config = serde_json::from_str(
        r#"{"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 64}"#,
    )
    .unwrap();
    let path = Path::new("p.jsonl");
    let ok = vec![(1, vec![5; 32])];
    check_prompts(&ok, path, &target, 32).unwrap();
    let err = check_prompts(&ok, path, &target, 33).unwrap_err();
    assert!(
        err.contains("p.jsonl:1") && err.contains("context of 64"),
        "{err}"
    );
    let err = check_prompts(&[(4, vec![1, 100])], path, &target, 1).unwrap_err();
    assert!(
        err.contains("p.jsonl:4") && err.contains("token id 100"),
        "{err}"
    );
}

#[test]
fn eos_tokens_come_from_generation_config_then_config() {
    let dir = std::env::temp_dir().join(format!("dflash-eos-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    assert_eq!(eos_tokens(&dir).unwrap(), Vec::<u32>::new());
    std::fs::write(dir.join("config.json"), r#"{"eos_token_id": 2}"#).unwrap();
    assert_eq!(eos_tokens(&dir).unwrap(), vec![2]);
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [7, 9]}"#,
    )
    .unwrap();
    assert_eq!(eos_tokens(&dir).unwrap(), vec![7, 9]);
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": -1}"#,
    )
    .unwrap();
    assert!(eos_tokens(&dir).unwrap_err().contains("eos_token_id"));
    std::fs::remove_dir_all(&dir).unwrap();
}
