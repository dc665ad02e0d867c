//! torchrun's error files: where a worker's `@record` (torch.distributed.elastic's
//! `ErrorHandler`) writes the exception that ended it, as JSON at `TORCHELASTIC_ERROR_FILE`,
//! read back for the root-cause report.
//!
//! The format is PyTorch's: `{"message": {"message": "ValueError: bad shard 7", "extraInfo":
//! {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}`, or an older
//! `{"message": "..."}`; trainctl.torch adds `"trainctl": "unrecoverable"` to `extraInfo` for
//! an error no retry can fix (its `UsageError` and `DivergedError`). Nothing in the file is trusted: it is read up to [`MAX_BYTES`], and a
//! file that is not that JSON is reported as such, never a panic.

use std::io::Read;
use std::path::Path;

/// The most of an error file that is read (a traceback of a deep recursion is the largest
/// honest one; PyTorch writes no limit).
pub(crate) const MAX_BYTES: u64 = 1 << 20;

/// Frames of the traceback kept for the report, innermost last.
pub const FRAMES: usize = 4;

/// One frame of a Python traceback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub file: String,
    pub line: u32,
    pub function: String,
    /// The source line, when the traceback shows it.
    pub code: Option<String>,
}

impl std::fmt::Display for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{} in {}", self.file, self.line, self.function)?;
        if let Some(code) = &self.code {
            write!(f, ": {code}")?;
        }
        Ok(())
    }
}

/// What a worker's error file says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerError {
    /// `Type: message`, as PyTorch writes it (the exception's first line when long).
    pub message: String,
    /// The traceback's innermost frames, innermost last (at most [`FRAMES`]).
    pub frames: Vec<Frame>,
    /// When the worker recorded it, in seconds since the Unix epoch.
    pub timestamp: Option<u64>,
    /// The program marked it as one no retry can fix.
    pub unrecoverable: bool,
    /// For an unrecoverable error, the message's lines after the first (at most
    /// [`MORE_LINES`]): trainctl.torch's say which ranks differ in what, and what to do.
    pub more: Vec<String>,
}

/// The most lines of an unrecoverable error's message kept after its first.
pub const MORE_LINES: usize = 8;

/// Reads the error file at `path`: `Ok(None)` when the worker wrote none.
pub fn read(path: &Path) -> Result<Option<WorkerError>, String> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let mut bytes = Vec::new();
    file.take(MAX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if bytes.len() as u64 > MAX_BYTES {
        return Err(format!(
            "{} is larger than {MAX_BYTES} bytes: not read",
            path.display()
        ));
    }
    parse(&bytes)
        .map(Some)
        .map_err(|e| format!("{} is not an error file torch writes ({e})", path.display()))
}

/// An error file's bytes.
pub fn parse(bytes: &[u8]) -> Result<WorkerError, String> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let message = &value["message"];
    let (text, extra) = match message {
        serde_json::Value::String(s) => (s.as_str(), &serde_json::Value::Null),
        serde_json::Value::Object(m) => (
            m.get("message")
                .and_then(|m| m.as_str())
                .ok_or("no message.message")?,
            m.get("extraInfo").unwrap_or(&serde_json::Value::Null),
        ),
        _ => return Err("no message".into()),
    };
    let timestamp = match &extra["timestamp"] {
        serde_json::Value::String(s) => s.trim().parse().ok(),
        serde_json::Value::Number(n) => n.as_u64(),
        _ => None,
    };
    let frames = extra["py_callstack"]
        .as_str()
        .map(innermost_frames)
        .unwrap_or_default();
    let unrecoverable = extra["trainctl"].as_str() == Some("unrecoverable");
    let more = if unrecoverable {
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .skip(1)
            .take(MORE_LINES)
            .map(|l| l.chars().take(300).collect())
            .collect()
    } else {
        Vec::new()
    };
    Ok(WorkerError {
        message: first_line(text),
        frames,
        timestamp,
        unrecoverable,
        more,
    })
}

/// The message's first line, at most 500 characters: the report stays one screen.
fn first_line(text: &str) -> String {
    let line = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    let mut out: String = line.chars().take(500).collect();
    if out.len() < line.len() {
        out.push_str("...");
    }
    out
}

/// The innermost [`FRAMES`] frames of a Python traceback (`File "x.py", line 12, in f`, the
/// source line below it), innermost last. With chained exceptions the last traceback is the
/// one that ended the program.
pub(crate) fn innermost_frames(traceback: &str) -> Vec<Frame> {
    let mut frames: Vec<Frame> = Vec::new();
    let mut lines = traceback.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("Traceback (most recent call last)") {
            frames.clear();
            continue;
        }
        let Some(frame) = parse_frame(trimmed) else {
            continue;
        };
        // The source line is indented under its frame; the exception's own line is not.
        let indent = |l: &str| l.len() - l.trim_start().len();
        let code = lines
            .peek()
            .filter(|next| indent(next) > indent(line))
            .map(|next| next.trim())
            .filter(|next| !next.is_empty() && !next.starts_with("File \"") && !is_marker(next))
            .map(|next| next.chars().take(200).collect::<String>());
        if code.is_some() {
            lines.next();
        }
        frames.push(Frame { code, ..frame });
    }
    let skip = frames.len().saturating_sub(FRAMES);
    frames.split_off(skip)
}

/// Python 3.11's `^^^^` and `~~~` lines under the source.
fn is_marker(line: &str) -> bool {
    line.chars().all(|c| matches!(c, '^' | '~' | ' '))
}

/// `File "x.py", line 12, in f`.
fn parse_frame(line: &str) -> Option<Frame> {
    let rest = line.strip_prefix("File \"")?;
    let (file, rest) = rest.split_once("\", line ")?;
    let (number, function) = match rest.split_once(", in ") {
        Some((n, f)) => (n, f.trim()),
        None => (rest, "?"),
    };
    Some(Frame {
        file: file.chars().take(300).collect(),
        line: number.trim().parse().ok()?,
        function: function.chars().take(200).collect(),
        code: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What torch 2.x's `ErrorHandler.record_exception` writes for a `ValueError` raised two
    /// calls deep (Python 3.11, with its `^^^` markers).
    const TORCH: &str = r#"{"message": {"message": "ValueError: bad shard 7", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py\", line 362, in wrapper\n    return f(*args, **kwargs)\n           ^^^^^^^^^^^^^^^^^^\n  File \"/job/train.py\", line 20, in main\n    load(7)\n  File \"/job/train.py\", line 12, in load\n    raise ValueError(f\"bad shard {n}\")\nValueError: bad shard 7\n", "timestamp": "1700000123"}}}"#;

    #[test]
    fn torchs_error_file_is_read() {
        let e = parse(TORCH.as_bytes()).unwrap();
        assert_eq!(e.message, "ValueError: bad shard 7");
        assert_eq!(e.timestamp, Some(1_700_000_123));
        let frames: Vec<String> = e.frames.iter().map(|f| f.to_string()).collect();
        assert_eq!(
            frames,
            [
                "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py:362 in wrapper: return f(*args, **kwargs)",
                "/job/train.py:20 in main: load(7)",
                "/job/train.py:12 in load: raise ValueError(f\"bad shard {n}\")",
            ]
        );
    }

    #[test]
    fn the_older_format_and_chained_tracebacks() {
        let e = parse(br#"{"message": "RuntimeError: boom\nmore"}"#).unwrap();
        assert_eq!(e.message, "RuntimeError: boom");
        assert!(e.frames.is_empty() && e.timestamp.is_none());
        let chained = "Traceback (most recent call last):\n  File \"a.py\", line 1, in f\nKeyError: 1\n\nDuring handling of the above exception, another exception occurred:\n\nTraceback (most recent call last):\n  File \"b.py\", line 2, in g\n    h()\n  File \"b.py\", line 5, in h\nOSError: x\n";
        let frames = innermost_frames(chained);
        assert_eq!(
            frames.iter().map(|f| f.to_string()).collect::<Vec<_>>(),
            ["b.py:2 in g: h()", "b.py:5 in h"]
        );
    }

    #[test]
    fn bad_files_are_refused_with_a_reason() {
        for bad in [
            &b""[..],
            b"{",
            b"[]",
            b"{\"message\": 3}",
            b"{\"message\": {}}",
        ] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(&dir.path().join("none")), Ok(None));
        let huge = dir.path().join("huge");
        std::fs::write(&huge, vec![b' '; MAX_BYTES as usize + 1]).unwrap();
        let err = read(&huge).unwrap_err();
        assert!(err.contains("larger than 1048576 bytes"), "{err}");
        let garbage = dir.path().join("garbage");
        std::fs::write(&garbage, b"\xff\xfe not json").unwrap();
        let err = read(&garbage).unwrap_err();
        assert!(err.contains("is not an error file torch writes"), "{err}");
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_are_read_or_refused(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            let _ = parse(&bytes);
        }

        #[test]
        fn any_traceback_text_gives_at_most_the_innermost_frames(text in "(File \"[a-z.]{0,6}\", line [0-9]{0,3}, in [a-z]{0,4}\n|Traceback \\(most recent call last\\):\n|[ ^a-z]{0,8}\n){0,12}") {
            let frames = innermost_frames(&text);
            proptest::prop_assert!(frames.len() <= FRAMES);
        }
    }
}
