//! What the decoding workers of `eval` and `generate` print, read with bounds: their answer
//! lines (each at most as long as the request allows) and the last lines of their log, which a
//! failure quotes.

use std::io::{BufRead, Read};
use std::sync::{Arc, Mutex, PoisonError};

/// Bytes of a token id in an answer line at most (`4294967295,`).
const TOKEN_BYTES: usize = 11;

/// Room for an answer's other fields (numbers, names).
const LINE_OVERHEAD: usize = 4096;

/// The longest answer line a worker may print for `tokens` token ids at most.
pub fn max_line(tokens: usize) -> usize {
    tokens
        .saturating_mul(TOKEN_BYTES)
        .saturating_add(LINE_OVERHEAD)
}

/// One line read from a worker.
#[derive(Debug, PartialEq)]
pub enum Line {
    Text(String),
    /// Its output ended.
    Closed,
    /// A fault: what was wrong with the line.
    Bad(String),
}

/// Reads one line of at most `max` bytes (its newline not counted), never buffering more.
pub fn read_line(reader: &mut impl BufRead, max: usize) -> Line {
    let mut buf = Vec::new();
    match reader.take(max as u64 + 1).read_until(b'\n', &mut buf) {
        Ok(0) => return Line::Closed,
        Ok(_) => {}
        Err(e) => return Line::Bad(format!("its output could not be read: {e}")),
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > max {
        return Line::Bad(format!(
            "printed a line longer than the {max} bytes its answers can take"
        ));
    } else {
        return Line::Bad("closed its output in the middle of a line".into());
    }
    match String::from_utf8(buf) {
        Ok(text) => Line::Text(text),
        Err(_) => Line::Bad("printed a line that is not UTF-8".into()),
    }
}

/// The most of a worker's log kept.
const KEPT: usize = 16 * 1024;

/// Lines of the log a failure quotes, and the most of each.
const QUOTED_LINES: usize = 12;
const QUOTED_LINE: usize = 300;

/// The last bytes of a worker's stderr, read on a thread of its own.
#[derive(Clone, Default)]
pub struct LogTail(Arc<Mutex<Vec<u8>>>);

impl LogTail {
    /// Reads `from` to its end on a thread of its own; returns the thread, ended when the log
    /// ends.
    pub fn follow(&self, mut from: impl Read + Send + 'static) -> std::thread::JoinHandle<()> {
        let kept = Arc::clone(&self.0);
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = from.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let mut kept = kept.lock().unwrap_or_else(PoisonError::into_inner);
                kept.extend_from_slice(&buf[..n]);
                if kept.len() > 2 * KEPT {
                    let cut = kept.len() - KEPT;
                    kept.drain(..cut);
                }
            }
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(PoisonError::into_inner)).into_owned()
    }
}

/// A worker's reason and the lines of its log before it, for an error message: the last
/// non-empty line (its `error: ` prefix dropped) as the reason, clipped; then up to
/// [`QUOTED_LINES`] lines before it, each clipped and indented, under a heading, less those the
/// reason already says (a child's own `error:` line, which the worker's wraps) and Python's
/// `^^^^` markers. "it printed nothing" when the log is empty.
pub fn last_words(log: &str) -> (String, String) {
    let lines: Vec<&str> = log
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty())
        .collect();
    let Some((last, before)) = lines.split_last() else {
        return ("it printed nothing".into(), String::new());
    };
    let reason = crate::format::clip(last.trim().trim_start_matches("error: "), 600);
    let before: Vec<&str> = before
        .iter()
        .copied()
        .filter(|l| !l.trim().chars().all(|c| matches!(c, '^' | '~' | ' ')))
        .filter(|l| !reason.contains(l.trim().trim_start_matches("error: ")))
        .collect();
    let shown = &before[before.len().saturating_sub(QUOTED_LINES)..];
    if shown.is_empty() {
        return (reason, String::new());
    }
    let mut quoted = String::from("\n  its last lines before that:");
    for line in shown {
        quoted.push_str("\n    ");
        quoted.push_str(&crate::format::clip(line, QUOTED_LINE));
    }
    (reason, quoted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_read_within_their_bound_and_faults_named() {
        let mut r = std::io::Cursor::new(b"abc\n\xff\xfe\nxxxxxxxx\nend".to_vec());
        assert_eq!(read_line(&mut r, 8), Line::Text("abc".into()));
        assert_eq!(
            read_line(&mut r, 8),
            Line::Bad("printed a line that is not UTF-8".into())
        );
        // Exactly the bound is a line.
        assert_eq!(read_line(&mut r, 8), Line::Text("xxxxxxxx".into()));
        assert_eq!(
            read_line(&mut r, 8),
            Line::Bad("closed its output in the middle of a line".into())
        );
        assert_eq!(read_line(&mut r, 8), Line::Closed);
        // One byte over is refused without reading the rest.
        let mut r = std::io::Cursor::new(vec![b'a'; 1000]);
        match read_line(&mut r, 8) {
            Line::Bad(why) => assert!(why.contains("longer than the 8 bytes"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(r.position(), 9);
        assert_eq!(max_line(2), 22 + LINE_OVERHEAD);
        assert_eq!(max_line(usize::MAX), usize::MAX);
    }

    #[test]
    fn the_last_words_are_the_reason_and_the_lines_before_it_clipped() {
        assert_eq!(last_words(""), ("it printed nothing".into(), String::new()));
        let (reason, before) = last_words("error: ValueError: bad\n\n");
        assert_eq!((reason.as_str(), before.as_str()), ("ValueError: bad", ""));
        // What the reason says already, and Python's markers, are not quoted again.
        let (reason, before) = last_words(
            "Traceback:\n  load()\n  ^^^^^^\nerror: ValueError: bad\nerror: the decoder failed: ValueError: bad\n",
        );
        assert_eq!(reason, "the decoder failed: ValueError: bad");
        assert_eq!(
            before,
            "\n  its last lines before that:\n    Traceback:\n      load()"
        );
        let mut log = String::new();
        for i in 0..30 {
            log.push_str(&format!("line {i}\n"));
        }
        log.push_str(&"x".repeat(5000));
        log.push_str("\nerror: the decoder failed\n");
        let (reason, before) = last_words(&log);
        assert_eq!(reason, "the decoder failed");
        assert!(
            before.contains("line 29") && !before.contains("line 18"),
            "{before}"
        );
        assert!(before.lines().all(|l| l.len() < 400), "{before}");
        assert_eq!(before.trim_start().lines().count(), QUOTED_LINES + 1);
    }
}
