use super::*;
use clap::Parser;

/// A scratch directory of this test process, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("dflash-init-tiny-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: InitTinyArgs,
}

fn parse(extra: &[&str]) -> Result<InitTinyArgs, clap::Error> {
    let mut argv = vec!["init-tiny", "--output", "x"];
    argv.extend(extra);
    Cli::try_parse_from(argv).map(|c| c.args)
}

fn spec(extra: &[&str]) -> Result<ModelSpec, String> {
    parse(extra).expect("parses").spec(600)
}

#[test]
fn the_default_is_the_tiny_shape_and_presets_give_way_to_explicit_options() {
    let tiny = spec(&[]).unwrap();
    assert_eq!(
        tiny.shape,
        Qwen3Shape {
            vocab: 600,
            hidden: 64,
            intermediate: 128,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            rms_eps: 1e-6,
            rope_theta: 1_000_000.0,
        }
    );
    assert!(!tiny.tie_word_embeddings);
    assert_eq!(spec(&["--preset", "tiny"]).unwrap(), tiny);
    // The tiny preset's sizes follow --hidden-size, as they always have.
    let wide = spec(&["--hidden-size", "128"]).unwrap().shape;
    assert_eq!((wide.head_dim, wide.intermediate), (32, 256));

    let real = spec(&["--preset", "qwen3-0.6b"]).unwrap();
    assert_eq!(
        real.shape,
        Qwen3Shape {
            vocab: 151_936,
            hidden: 1024,
            intermediate: 3072,
            layers: 28,
            heads: 16,
            kv_heads: 8,
            head_dim: 128,
            rms_eps: 1e-6,
            rope_theta: 1_000_000.0,
        }
    );
    assert!(real.tie_word_embeddings);
    assert_eq!(real.max_position_embeddings, 40960);
    let fewer = spec(&["--preset", "qwen3-0.6b", "--layers", "2", "--vocab", "4096"]).unwrap();
    assert_eq!((fewer.shape.layers, fewer.shape.vocab), (2, 4096));
    assert_eq!(fewer.shape.hidden, 1024);
    // The embedding is the output head: no lm_head tensor.
    assert!(
        !stored_tensors(&fewer)
            .iter()
            .any(|(n, ..)| n == "lm_head.weight")
    );
}

#[test]
fn bad_values_are_refused_by_the_parsers() {
    for (flag, bad) in [
        ("--heads", "0"),
        ("--heads", "2000"),
        ("--kv-heads", "0"),
        ("--head-dim", "1"),
        ("--head-dim", "x"),
        ("--intermediate", "0"),
        ("--vocab", "0"),
        ("--vocab", "-5"),
        ("--hidden-size", "8"),
        ("--layers", "0"),
        ("--preset", "qwen3-8b"),
        ("--dtype", "f16"),
    ] {
        let e = parse(&[&format!("{flag}={bad}")]).expect_err("refused");
        assert_eq!(e.exit_code(), 2, "{flag} {bad}");
        assert!(e.to_string().contains(flag), "{flag} {bad}: {e}");
    }
}

#[test]
fn shapes_that_do_not_fit_together_are_refused_with_the_reason() {
    for (extra, needle) in [
        (
            &["--heads", "6", "--kv-heads", "4"][..],
            "not a multiple of --kv-heads",
        ),
        (&["--head-dim", "15"][..], "odd"),
        (&["--hidden-size", "36"][..], "odd"),
        (
            &["--hidden-size", "100", "--heads", "8"][..],
            "not a multiple of --heads",
        ),
        (
            &["--vocab", "100"][..],
            "smaller than the bundled tokenizer",
        ),
        (&["--heads", "1024", "--head-dim", "1024"][..], "too large"),
    ] {
        let e = spec(extra).expect_err("refused");
        assert!(e.contains(needle), "{extra:?}: {e}");
    }
}

#[test]
fn the_split_normal_matches_the_generators_own() {
    let mut a = PlanRng::stream(3, 0, Purpose::Synthetic);
    let mut b = a.clone();
    for _ in 0..10_000 {
        let (x, y) = (b.next_u64(), b.next_u64());
        assert_eq!(
            a.standard_normal().to_bits(),
            standard_normal(x, y).to_bits()
        );
    }
}

#[test]
fn bf16_rounds_to_nearest_even() {
    assert_eq!(bf16_bits(1.0), 0x3F80);
    assert_eq!(bf16_bits(-2.0), 0xC000);
    assert_eq!(bf16_bits(0.0), 0);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even (1.0).
    assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3F80);
    // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: the even one is 1 + 2^-6.
    assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3F82);
    // Just above halfway rounds up.
    assert_eq!(bf16_bits(f32::from_bits(0x3F80_8001)), 0x3F81);
    assert_eq!(bf16_bits(0.02), 0x3CA4);
}

/// The streamed writer gives exactly the file the `safetensors` crate writes from the same
/// values drawn one after another (the way the file was always made).
#[test]
fn streamed_weights_equal_the_crates_serialization() {
    let dir = Scratch::new("streamed");
    for (extra, dtype) in [
        (
            &["--hidden-size", "32", "--layers", "2"][..],
            WeightDtype::F32,
        ),
        (
            &[
                "--preset",
                "qwen3-0.6b",
                "--hidden-size",
                "32",
                "--layers",
                "1",
                "--vocab",
                "700",
                "--intermediate",
                "48",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--head-dim",
                "8",
            ][..],
            WeightDtype::Bf16,
        ),
    ] {
        let mut spec = spec(extra).unwrap();
        spec.dtype = dtype;
        let streamed = dir.0.join("streamed.safetensors");
        let stop = AtomicBool::new(false);
        let size = write_weights(&streamed, &spec, 5, &stop).ok().unwrap();

        let mut rng = PlanRng::stream(5, 0, Purpose::Synthetic);
        let tensors = stored_tensors(&spec);
        let data: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(name, dims, is_norm)| {
                let n: usize = dims.iter().product();
                let std = if name.contains("embed_tokens") || name.starts_with("lm_head") {
                    4.0 / (spec.shape.hidden as f64).sqrt()
                } else {
                    0.02
                };
                (0..n)
                    .flat_map(|_| {
                        let v = if *is_norm {
                            1.0
                        } else {
                            (std * rng.standard_normal()) as f32
                        };
                        match dtype {
                            WeightDtype::F32 => v.to_le_bytes().to_vec(),
                            WeightDtype::Bf16 => bf16_bits(v).to_le_bytes().to_vec(),
                        }
                    })
                    .collect()
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .zip(&data)
            .map(|((name, dims, _), bytes)| {
                let view =
                    safetensors::tensor::TensorView::new(dtype.safetensors(), dims.clone(), bytes)
                        .unwrap();
                (name.clone(), view)
            })
            .collect();
        let metadata: HashMap<String, String> = [("format".to_owned(), "pt".to_owned())].into();
        let expected = safetensors::serialize(views, Some(metadata)).unwrap();
        let got = std::fs::read(&streamed).unwrap();
        assert_eq!(got.len() as u64, size);
        assert!(got == expected, "{extra:?} {dtype:?}: the files differ");
    }
}

#[test]
fn a_stop_request_ends_the_writing() {
    let dir = Scratch::new("stop");
    let spec = spec(&[]).unwrap();
    let stop = AtomicBool::new(true);
    assert!(matches!(
        write_weights(&dir.0.join("w"), &spec, 0, &stop),
        Err(WriteError::Interrupted)
    ));
}
