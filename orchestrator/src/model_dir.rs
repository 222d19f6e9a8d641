//! The checks of a target model directory made before a run starts (or `eval`, `generate`
//! use it): every tensor the run needs is in the weights, with the shape `config.json` implies,
//! and the data each tensor table describes is all there. The weights themselves are not read.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use dflash_common::dflash::{ModelDirError, Qwen3Config, weight_files};
use safetensors::{Dtype, SafeTensors};

/// The raw header of a safetensors file: its 8-byte length and JSON tensor table, as stored
/// (what identifies a target without its gigabytes of weights).
pub fn header_bytes(path: &Path) -> Result<Vec<u8>, ModelDirError> {
    let mut file = std::fs::File::open(path)
        .map_err(|e| ModelDirError::new(path, format!("cannot open: {e}")))?;
    let mut head = [0u8; 8];
    file.read_exact(&mut head).map_err(|_| {
        ModelDirError::new(path, "not a safetensors file (shorter than its header)")
    })?;
    let n = u64::from_le_bytes(head);
    let size = file.metadata().map_or(0, |m| m.len());
    if n > 100_000_000 || n.saturating_add(8) > size {
        return Err(ModelDirError::new(
            path,
            format!("not a safetensors file (header of {n} bytes in a file of {size})"),
        ));
    }
    let mut bytes = head.to_vec();
    bytes.resize(8 + n as usize, 0);
    file.read_exact(&mut bytes[8..])
        .map_err(|e| ModelDirError::new(path, format!("cannot read the header: {e}")))?;
    Ok(bytes)
}

/// The tensor table (name -> shape) of a safetensors file, read by the `safetensors` crate from
/// a mapping of the file (only the header's pages are touched), which also checks that the data
/// the table describes fills the file exactly. Only float tensors are accepted.
pub fn tensor_shapes(path: &Path) -> Result<BTreeMap<String, Vec<usize>>, ModelDirError> {
    let file = std::fs::File::open(path)
        .map_err(|e| ModelDirError::new(path, format!("cannot open: {e}")))?;
    // SAFETY: the mapping is read only while this function runs, and only its header is parsed;
    // a model directory changed under a starting run is outside the contract.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| ModelDirError::new(path, format!("cannot map: {e}")))?;
    let (_, metadata) = SafeTensors::read_metadata(&map).map_err(|e| {
        ModelDirError::new(
            path,
            format!("not a complete safetensors file: {e} (file truncated or damaged?)"),
        )
    })?;
    let mut shapes = BTreeMap::new();
    for (name, info) in metadata.tensors() {
        if !matches!(info.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            return Err(ModelDirError::new(
                path,
                format!(
                    "tensor {name} has dtype {:?} (F32, F16 or BF16 expected)",
                    info.dtype
                ),
            ));
        }
        shapes.insert(name, info.shape.clone());
    }
    Ok(shapes)
}

/// The tensor names of a safetensors file, from its header alone (tensors of any dtype).
pub fn tensor_names(path: &Path) -> Result<Vec<String>, ModelDirError> {
    let bytes = header_bytes(path)?;
    let table: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..])
        .map_err(|e| ModelDirError::new(path, format!("not a safetensors header: {e}")))?;
    Ok(table
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| k != "__metadata__")
        .collect())
}

/// Checks what the torch drafter reads of a torch target's weights (`load_heads`,
/// python/dflash_orch/drafter.py): its input embedding, the one `*embed_tokens.weight` tensor.
/// (Whether the output head is tied to it, the drafter reads from the config as `transformers`
/// does; the target's other tensors are `transformers`' to judge.)
pub fn check_torch_heads(dir: &Path) -> Result<(), ModelDirError> {
    let mut embeds = Vec::new();
    for file in weight_files(dir)? {
        embeds.extend(
            tensor_names(&file)?
                .into_iter()
                .filter(|n| n.ends_with("embed_tokens.weight")),
        );
    }
    if embeds.len() == 1 {
        return Ok(());
    }
    embeds.sort();
    Err(ModelDirError::new(
        dir,
        format!(
            "the drafter takes the target's input embedding from its one *embed_tokens.weight tensor, and the weights have {}",
            if embeds.is_empty() {
                "none".to_string()
            } else {
                format!("{embeds:?}")
            }
        ),
    ))
}

/// Checks that the weights in `dir` hold every tensor a run needs, with the shapes `config`
/// implies: the embedding, the output head (unless tied), the decoder layers up to `layers`,
/// and the final norm when every layer runs.
pub fn check_weights(dir: &Path, config: &Qwen3Config, layers: usize) -> Result<(), ModelDirError> {
    let mut shapes = BTreeMap::new();
    for file in weight_files(dir)? {
        shapes.append(&mut tensor_shapes(&file)?);
    }
    let wanted = config.shape().tensors(layers);
    let needed = |name: &str| match name {
        "lm_head.weight" => !config.tie_word_embeddings,
        "model.norm.weight" => layers >= config.num_hidden_layers,
        _ => true,
    };
    for (name, shape, _) in wanted.into_iter().filter(|(n, ..)| needed(n)) {
        match shapes.get(&name) {
            None => {
                return Err(ModelDirError::new(
                    dir,
                    format!(
                        "the weights have no {name} (config.json says Qwen3 with {} layers)",
                        config.num_hidden_layers
                    ),
                ));
            }
            Some(found) if *found != shape => {
                return Err(ModelDirError::new(
                    dir,
                    format!("{name} has shape {found:?}, config.json implies {shape:?}"),
                ));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_safetensors_files_are_named_not_panicked_on() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.safetensors");
        let table = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        for bytes in [
            Vec::new(),
            b"abc".to_vec(),
            [&u64::MAX.to_le_bytes()[..], b"{}"].concat(),
            [&2u64.to_le_bytes()[..], b"[]"].concat(),
            // The table promises 8 bytes of data that are not there.
            [&54u64.to_le_bytes()[..], table].concat(),
            // Offsets past the data.
            [
                &54u64.to_le_bytes()[..],
                br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,9]}}"#,
                &[0u8; 9],
            ]
            .concat(),
        ] {
            std::fs::write(&p, &bytes).unwrap();
            let e = tensor_shapes(&p).unwrap_err().to_string();
            assert!(e.starts_with(&p.display().to_string()), "{e}");
            assert!(e.contains("safetensors") || e.contains("cannot map"), "{e}");
        }
        let ints = [
            &54u64.to_le_bytes()[..],
            br#"{"a":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}}"#,
            &[0u8; 8],
        ]
        .concat();
        std::fs::write(&p, &ints).unwrap();
        let e = tensor_shapes(&p).unwrap_err().to_string();
        assert!(e.contains("dtype I32"), "{e}");

        let good = [&54u64.to_le_bytes()[..], table, &[0u8; 8]].concat();
        std::fs::write(&p, &good).unwrap();
        assert_eq!(tensor_shapes(&p).unwrap()["a"], vec![2]);
        assert_eq!(header_bytes(&p).unwrap(), good[..62]);
        std::fs::write(&p, b"abc").unwrap();
        let e = header_bytes(&p).unwrap_err().to_string();
        assert!(e.contains("shorter than its header"), "{e}");
        std::fs::write(&p, [&u64::MAX.to_le_bytes()[..], b"{}"].concat()).unwrap();
        let e = header_bytes(&p).unwrap_err().to_string();
        assert!(e.contains("header of"), "{e}");
    }
}
