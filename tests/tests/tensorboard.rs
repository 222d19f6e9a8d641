//! TensorBoard event files written by `TbWriter` read back with TensorBoard's own reader
//! (`scripts/read_tensorboard.py`, EventAccumulator) in the test venv.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use dflash_e2e::{script, stdout_ok, test_python};
use dflash_orch::observe::tensorboard::{TbWriter, read_scalars};
use serde_json::Value;

/// Scalars as TensorBoard reads them from `path` (an event file or a directory).
fn tensorboard_scalars(path: &Path) -> BTreeMap<String, Vec<(i64, f32)>> {
    let out = Command::new(test_python())
        .arg(script("read_tensorboard.py"))
        .arg(path)
        .output()
        .unwrap();
    let json: Value = serde_json::from_str(&stdout_ok(&out)).unwrap();
    json["tags"]
        .as_object()
        .unwrap_or_else(|| panic!("no tags object: {json}"))
        .iter()
        .map(|(tag, points)| {
            let points = points
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_i64().unwrap(), p[1].as_f64().unwrap() as f32))
                .collect();
            (tag.clone(), points)
        })
        .collect()
}

/// Bit patterns, so that -0.0 and 0.0 differ and equality is exact.
fn bits(points: &[(i64, f32)]) -> Vec<(i64, u32)> {
    points.iter().map(|&(s, v)| (s, v.to_bits())).collect()
}

#[test]
fn tensorboard_reads_back_written_scalars_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let tb_dir = dir.path().join("run/tb");
    let mut writer = TbWriter::create(&tb_dir).unwrap();
    let mut want: BTreeMap<String, Vec<(i64, f32)>> = BTreeMap::new();
    let tags = [
        "train/loss",
        "train/lr",
        "pipeline/tokens_per_s",
        "gpu0/power_w",
    ];
    for step in 1..=12i64 {
        let s = step as f64;
        let values = [
            2.0 / s + 0.1, // not representable in f32: rounded once, on write
            3e-4 * (1.0 - s / 20.0),
            123_456.789 * s,
            if step % 4 == 0 { 0.0 } else { -17.25 * s }, // 0.0 must survive (presence)
        ];
        for (tag, value) in tags.iter().zip(values) {
            let step = if tag.starts_with("gpu") {
                step * 1_000_000_007
            } else {
                step
            };
            writer.scalar(tag, step, value, 1.75e9 + s).unwrap();
            want.entry(tag.to_string())
                .or_default()
                .push((step, value as f32));
        }
    }
    writer.flush().unwrap();
    let file = writer.path().to_path_buf();
    assert_eq!(file.parent(), Some(tb_dir.as_path()));
    assert!(
        file.file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("events.out.tfevents."),
        "{}",
        file.display()
    );

    for path in [&file, &tb_dir] {
        let got = tensorboard_scalars(path);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "tags read from {}",
            path.display()
        );
        for (tag, points) in &want {
            assert_eq!(
                bits(&got[tag]),
                bits(points),
                "{tag} from {}",
                path.display()
            );
        }
    }

    // The crate's own reader agrees, in file order.
    let own = read_scalars(&file).unwrap();
    assert_eq!(own.len(), 12 * tags.len());
    let mut by_tag: BTreeMap<String, Vec<(i64, f32)>> = BTreeMap::new();
    for (tag, step, value) in own {
        by_tag.entry(tag).or_default().push((step, value));
    }
    for (tag, points) in &want {
        assert_eq!(bits(&by_tag[tag]), bits(points), "{tag} from read_scalars");
    }
}
