//! Every parser of outside input, fed arbitrary bytes and strings: an answer (value or error),
//! never a panic.

#![cfg(test)]

use proptest::prelude::*;

use crate::ingest::chat::parse_conversation;
use crate::ingest::jsonl::parse_pretokenized;
use crate::planner::{BucketSpec, Interleave, Mode, OverlongPolicy};
use crate::runtime::control::parse_request;
use crate::runtime::spec::{GpuSpec, Topology};
use crate::workload::parse_lengths;

/// Bytes that look like the inputs often enough to get past the first check.
fn inputs() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..200),
        "[ -~\\n]{0,200}".prop_map(String::into_bytes),
        (
            prop::sample::select(vec![
                r#"{"input_ids":"#,
                r#"{"input_ids":[1,2,"#,
                r#"{"conversations":[{"role":"#,
                r#"{"cmd":"restart","worker":"#,
                r#"{"event":"commit","epoch":"#,
                r#"{"format":"dflash-store","version":1,"#,
                r#"{"architectures":["DFlashDraftModel"],"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,"rms_norm_eps":0.1,"vocab_size":9,"#,
            ]),
            "[ -~]{0,80}"
        )
            .prop_map(|(head, tail)| format!("{head}{tail}").into_bytes()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn line_parsers(bytes in inputs()) {
        let _ = parse_lengths(&bytes);
        let _ = parse_pretokenized(&bytes);
        let _ = parse_conversation(&bytes);
        let _ = parse_request(&bytes);
        let _ = crate::store::parse_meta(std::path::Path::new("s"), &bytes);
        let _ = dflash_common::eval::DraftConfig::parse(&bytes);
    }

    #[test]
    fn option_parsers(text in "[ -~]{0,40}") {
        let _ = text.parse::<BucketSpec>().map(|b| b.validate(8192));
        let _ = text.parse::<GpuSpec>().map(|g| g.devices(Ok(8)));
        let _ = text.parse::<Topology>();
        let _ = text.parse::<Mode>();
        let _ = text.parse::<Interleave>();
        let _ = text.parse::<OverlongPolicy>();
        let _ = text.parse::<dflash_common::dflash::LossKind>();
        let _ = text.parse::<dflash_common::dflash::NonFinite>();
        let gamma = crate::options::gamma_choice();
        let cmd = clap::Command::new("t");
        let _ = clap::builder::TypedValueParser::parse_ref(
            &gamma,
            &cmd,
            None,
            std::ffi::OsStr::new(&text),
        )
        .map(|g| g.resolve(16));
    }

    #[test]
    fn journal_reader(bytes in inputs(), lines in prop::collection::vec(inputs(), 0..6)) {
        let dir = std::env::temp_dir().join(format!("dflash-journal-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("journal.jsonl");
        let mut all = br#"{"event":"run","version":1,"config":{}}"#.to_vec();
        for l in lines.iter().chain([&bytes]) {
            all.push(b'\n');
            all.extend_from_slice(l);
        }
        std::fs::write(&path, &all).unwrap();
        let _ = crate::runtime::journal::read(&path);
        std::fs::write(&path, &bytes).unwrap();
        let _ = crate::runtime::journal::read(&path);
    }

    #[test]
    fn ring_headers(bytes in prop::collection::vec(any::<u8>(), 0..400), magic in any::<bool>()) {
        let dir = std::env::temp_dir().join(format!("dflash-ring-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ring");
        let mut bytes = bytes;
        if magic && bytes.len() >= 8 {
            bytes[..8].copy_from_slice(&dflash_common::ring::MAGIC.to_le_bytes());
        }
        std::fs::write(&path, &bytes).unwrap();
        let _ = dflash_common::ring::Ring::open(&path);
    }
}
