//! Arrow-based inputs: Parquet files and Hugging Face `save_to_disk` directories (Arrow IPC
//! stream files), with `input_ids` and optional `loss_mask` integer-list columns.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use arrow_array::{Array, ArrayRef, OffsetSizeTrait, RecordBatch};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::{
    JsonNumber, Location, Position, RawSample, Reason, Sink, Stop, mask_values, token_ids,
};

/// Rows decoded at a time.
const BATCH_ROWS: usize = 1024;

/// The integer (or boolean) values under a list column.
enum Values<'a> {
    I8(&'a arrow_array::PrimitiveArray<Int8Type>),
    I16(&'a arrow_array::PrimitiveArray<Int16Type>),
    I32(&'a arrow_array::PrimitiveArray<Int32Type>),
    I64(&'a arrow_array::PrimitiveArray<Int64Type>),
    U8(&'a arrow_array::PrimitiveArray<UInt8Type>),
    U16(&'a arrow_array::PrimitiveArray<UInt16Type>),
    U32(&'a arrow_array::PrimitiveArray<UInt32Type>),
    U64(&'a arrow_array::PrimitiveArray<UInt64Type>),
    Bool(&'a arrow_array::BooleanArray),
}

impl Values<'_> {
    fn of(array: &ArrayRef) -> Option<Values<'_>> {
        Some(if let Some(a) = array.as_primitive_opt::<Int64Type>() {
            Values::I64(a)
        } else if let Some(a) = array.as_primitive_opt::<Int32Type>() {
            Values::I32(a)
        } else if let Some(a) = array.as_primitive_opt::<Int16Type>() {
            Values::I16(a)
        } else if let Some(a) = array.as_primitive_opt::<Int8Type>() {
            Values::I8(a)
        } else if let Some(a) = array.as_primitive_opt::<UInt64Type>() {
            Values::U64(a)
        } else if let Some(a) = array.as_primitive_opt::<UInt32Type>() {
            Values::U32(a)
        } else if let Some(a) = array.as_primitive_opt::<UInt16Type>() {
            Values::U16(a)
        } else if let Some(a) = array.as_primitive_opt::<UInt8Type>() {
            Values::U8(a)
        } else if let Some(a) = array.as_boolean_opt() {
            Values::Bool(a)
        } else {
            return None;
        })
    }

    fn get(&self, i: usize) -> JsonNumber {
        fn signed(v: i64) -> JsonNumber {
            if v < 0 {
                JsonNumber::Negative(v)
            } else {
                JsonNumber::Unsigned(v as u64)
            }
        }
        let null = match self {
            Values::I8(a) => a.is_null(i),
            Values::I16(a) => a.is_null(i),
            Values::I32(a) => a.is_null(i),
            Values::I64(a) => a.is_null(i),
            Values::U8(a) => a.is_null(i),
            Values::U16(a) => a.is_null(i),
            Values::U32(a) => a.is_null(i),
            Values::U64(a) => a.is_null(i),
            Values::Bool(a) => a.is_null(i),
        };
        if null {
            return JsonNumber::Other("null");
        }
        match self {
            Values::I8(a) => signed(i64::from(a.value(i))),
            Values::I16(a) => signed(i64::from(a.value(i))),
            Values::I32(a) => signed(i64::from(a.value(i))),
            Values::I64(a) => signed(a.value(i)),
            Values::U8(a) => JsonNumber::Unsigned(u64::from(a.value(i))),
            Values::U16(a) => JsonNumber::Unsigned(u64::from(a.value(i))),
            Values::U32(a) => JsonNumber::Unsigned(u64::from(a.value(i))),
            Values::U64(a) => JsonNumber::Unsigned(a.value(i)),
            Values::Bool(a) => JsonNumber::Bool(a.value(i)),
        }
    }
}

/// A list column of a record batch: per row, a range of `values` (or null).
struct ListColumn<'a> {
    name: &'static str,
    array: &'a ArrayRef,
    offsets: Vec<usize>,
    values: Values<'a>,
}

impl<'a> ListColumn<'a> {
    fn of(batch: &'a RecordBatch, name: &'static str) -> Result<Option<Self>, String> {
        let Some(array) = batch.column_by_name(name) else {
            return Ok(None);
        };
        fn parts<O: OffsetSizeTrait>(array: &ArrayRef) -> Option<(Vec<usize>, &ArrayRef)> {
            let list = array.as_list_opt::<O>()?;
            let offsets = list.value_offsets().iter().map(|o| o.as_usize()).collect();
            Some((offsets, list.values()))
        }
        let (offsets, values) = parts::<i32>(array)
            .or_else(|| parts::<i64>(array))
            .ok_or_else(|| {
                format!(
                    "column {name} has type {}, expected a list of integers",
                    array.data_type()
                )
            })?;
        let values = Values::of(values).ok_or_else(|| {
            format!(
                "column {name} has type {}, expected a list of integers",
                array.data_type()
            )
        })?;
        Ok(Some(Self {
            name,
            array,
            offsets,
            values,
        }))
    }

    fn row(&self, row: usize) -> Option<impl Iterator<Item = JsonNumber> + '_> {
        if self.array.is_null(row) {
            return None;
        }
        Some((self.offsets[row]..self.offsets[row + 1]).map(|i| self.values.get(i)))
    }
}

/// Hands every row of `batch` to the sink. `first_row` numbers the rows within the file.
fn read_batch(
    batch: &RecordBatch,
    file: &Path,
    first_row: u64,
    sink: &mut dyn Sink,
) -> Result<(), Stop> {
    let whole = Location {
        file: file.to_path_buf(),
        at: Position::Row(first_row),
    };
    let (ids, mask) = match (
        ListColumn::of(batch, "input_ids"),
        ListColumn::of(batch, "loss_mask"),
    ) {
        (Ok(Some(ids)), Ok(mask)) => (ids, mask),
        (Ok(None), _) => {
            return sink.reject(&whole, Reason::MissingField, "no input_ids column".into());
        }
        (Err(e), _) | (_, Err(e)) => return sink.reject(&whole, Reason::BadRecord, e),
    };
    for row in 0..batch.num_rows() {
        let at = Location {
            file: file.to_path_buf(),
            at: Position::Row(first_row + row as u64),
        };
        let Some(values) = ids.row(row) else {
            sink.reject(&at, Reason::MissingField, format!("{} is null", ids.name))?;
            continue;
        };
        let input_ids = match token_ids(values) {
            Ok(ids) => ids,
            Err(e) => {
                sink.reject(&at, Reason::BadTokenId, e)?;
                continue;
            }
        };
        let loss_mask = match mask.as_ref().and_then(|m| m.row(row)) {
            None => None,
            Some(values) => match mask_values(values) {
                Ok(m) => Some(m),
                Err(e) => {
                    sink.reject(&at, Reason::BadLossMask, e)?;
                    continue;
                }
            },
        };
        sink.accept(
            &at,
            RawSample {
                input_ids,
                loss_mask,
            },
        )?;
    }
    Ok(())
}

/// Hands every row of every batch to the sink; `rows_done` hears the running row count after each
/// batch. A batch that cannot be decoded rejects the rest of the file. Returns the rows read.
fn read_batches<E: std::fmt::Display>(
    path: &Path,
    batches: impl Iterator<Item = Result<RecordBatch, E>>,
    what: &str,
    sink: &mut dyn Sink,
    mut rows_done: impl FnMut(u64, &mut dyn Sink),
) -> Result<u64, Stop> {
    let mut row = 0u64;
    for batch in batches {
        let batch = match batch {
            Ok(b) => b,
            Err(e) => {
                let at = Location {
                    file: path.to_path_buf(),
                    at: Position::Row(row),
                };
                return sink
                    .reject(
                        &at,
                        Reason::UnreadableFile,
                        format!("not a readable {what}: {e}"),
                    )
                    .map(|()| row);
            }
        };
        read_batch(&batch, path, row, sink)?;
        row += batch.num_rows() as u64;
        rows_done(row, sink);
    }
    if row == 0 {
        let at = Location {
            file: path.to_path_buf(),
            at: Position::File,
        };
        sink.reject(&at, Reason::EmptyFile, "no rows".into())?;
    }
    Ok(row)
}

/// An input file opened for reading with its size, or `None` after rejecting it (the rejection's
/// message says it is not a readable `what`).
fn open_input(path: &Path, what: &str, sink: &mut dyn Sink) -> Result<Option<(File, u64)>, Stop> {
    match File::open(path) {
        Ok(f) => {
            let size = f.metadata().map(|m| m.len()).unwrap_or(0);
            Ok(Some((f, size)))
        }
        Err(e) => reject_file(path, what, &e, sink).map(|()| None),
    }
}

/// Rejects a whole input file that cannot be read as a `what`.
fn reject_file(
    path: &Path,
    what: &str,
    e: &dyn std::fmt::Display,
    sink: &mut dyn Sink,
) -> Result<(), Stop> {
    let at = Location {
        file: path.to_path_buf(),
        at: Position::File,
    };
    sink.reject(
        &at,
        Reason::UnreadableFile,
        format!("not a readable {what}: {e}"),
    )
}

/// Reads a Parquet file (only its `input_ids` and `loss_mask` columns are decoded).
pub fn read_parquet(path: &Path, sink: &mut dyn Sink) -> Result<(), Stop> {
    const WHAT: &str = "Parquet file";
    let Some((file, size)) = open_input(path, WHAT, sink)? else {
        return Ok(());
    };
    let builder = match ParquetRecordBatchReaderBuilder::try_new(file) {
        Ok(b) => b,
        Err(e) => return reject_file(path, WHAT, &e, sink),
    };
    let total_rows = builder.metadata().file_metadata().num_rows().max(1) as u64;
    let roots: Vec<usize> = builder
        .schema()
        .fields()
        .iter()
        .enumerate()
        .filter(|(_, f)| matches!(f.name().as_str(), "input_ids" | "loss_mask"))
        .map(|(i, _)| i)
        .collect();
    if !roots
        .iter()
        .any(|&i| builder.schema().field(i).name() == "input_ids")
    {
        let at = Location {
            file: path.to_path_buf(),
            at: Position::File,
        };
        return sink.reject(&at, Reason::MissingField, "no input_ids column".into());
    }
    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
    let reader = match builder
        .with_projection(mask)
        .with_batch_size(BATCH_ROWS)
        .build()
    {
        Ok(r) => r,
        Err(e) => return reject_file(path, WHAT, &e, sink),
    };
    let mut reported = 0u64;
    read_batches(path, reader, WHAT, sink, |rows, sink| {
        let done = size * rows.min(total_rows) / total_rows;
        sink.progress(done - reported);
        reported = done;
    })?;
    Ok(())
}

/// Reads one Arrow IPC stream file (a `save_to_disk` shard).
pub fn read_arrow_stream(path: &Path, sink: &mut dyn Sink) -> Result<(), Stop> {
    const WHAT: &str = "Arrow stream";
    let Some((file, size)) = open_input(path, WHAT, sink)? else {
        return Ok(());
    };
    let reader = match arrow_ipc::reader::StreamReader::try_new(BufReader::new(file), None) {
        Ok(r) => r,
        Err(e) => return reject_file(path, WHAT, &e, sink),
    };
    read_batches(path, reader, WHAT, sink, |_, _| {})?;
    sink.progress(size);
    Ok(())
}

/// The data files of a `save_to_disk` directory, from its `state.json`.
pub fn hf_disk_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let state_path = dir.join("state.json");
    let text = std::fs::read(&state_path)
        .map_err(|e| format!("{}: cannot read: {e}", state_path.display()))?;
    #[derive(serde::Deserialize)]
    struct State {
        #[serde(rename = "_data_files")]
        data_files: Vec<DataFile>,
    }
    #[derive(serde::Deserialize)]
    struct DataFile {
        filename: String,
    }
    let state: State = serde_json::from_slice(&text).map_err(|e| {
        format!(
            "{}: not a datasets state.json (expected _data_files): {e}",
            state_path.display()
        )
    })?;
    if state.data_files.is_empty() {
        return Err(format!("{}: lists no data files", state_path.display()));
    }
    state
        .data_files
        .into_iter()
        .map(|f| {
            let name = Path::new(&f.filename);
            if name.components().count() != 1 || name.is_absolute() {
                Err(format!(
                    "{}: data file {:?} is not a plain file name",
                    state_path.display(),
                    f.filename
                ))
            } else {
                Ok(dir.join(name))
            }
        })
        .collect()
}
