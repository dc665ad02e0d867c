//! TensorBoard event files: TFRecords of `tensorflow.Event` protocol buffers, the format
//! `tensorboard --logdir` reads. The messages are declared here with prost (only the fields
//! trainctl writes, with TensorFlow's field numbers), so no protoc and no TensorFlow protos are
//! needed to build.
//!
//! A TFRecord is `u64 length (LE) | u32 masked CRC-32C of the length | data | u32 masked
//! CRC-32C of the data`.

use std::io::Write;
use std::path::{Path, PathBuf};

use prost::Message;

/// `tensorflow.Event` (tensorflow/core/util/event.proto).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(oneof = "What", tags = "3, 5, 7")]
    pub what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
    #[prost(message, tag = "7")]
    SessionLog(SessionLog),
}

/// `tensorflow.SessionLog`: a START at step S tells TensorBoard to drop events after S left by
/// an earlier attempt (the steps a resumed run does again).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionLog {
    #[prost(int32, tag = "1")]
    pub status: i32,
}

pub(crate) const SESSION_START: i32 = 1;

/// `tensorflow.Summary` (tensorflow/core/framework/summary.proto).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Value {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
    #[prost(oneof = "Payload", tags = "2, 8")]
    pub payload: Option<Payload>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Payload {
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    #[prost(message, tag = "8")]
    Tensor(TensorProto),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginData {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    #[prost(bytes = "vec", tag = "2")]
    pub content: Vec<u8>,
}

/// `tensorflow.TensorProto`, for the one string tensor of a text summary.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorProto {
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShapeProto>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

pub(crate) const DT_STRING: i32 = 7;

#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShapeProto {
    #[prost(message, repeated, tag = "2")]
    pub dim: Vec<Dim>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Dim {
    #[prost(int64, tag = "1")]
    pub size: i64,
}

/// TFRecord's checksum: CRC-32C, rotated and offset so a CRC of CRCs is not a CRC.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord around `data`.
pub fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct EventFileError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Writes one event file. Every call writes whole records and flushes, so TensorBoard, which
/// reads the file as it grows, sees each step as it is written.
pub struct EventWriter {
    file: std::fs::File,
    path: PathBuf,
}

impl EventWriter {
    /// Creates a new event file in `dir`, named as TensorFlow names them
    /// (`events.out.tfevents.SECONDS.HOST.PID.N`), and writes its version record.
    pub fn create(dir: &Path) -> Result<Self, EventFileError> {
        let at = |path: &Path| {
            let path = path.to_path_buf();
            move |source| EventFileError { path, source }
        };
        std::fs::create_dir_all(dir).map_err(at(dir))?;
        let time = crate::unix_time();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty() && !h.contains('/'))
            .unwrap_or_else(|| "localhost".into());
        let mut n = 0;
        let (file, path) = loop {
            let path = dir.join(format!(
                "events.out.tfevents.{}.{host}.{}.{n}",
                time as u64,
                std::process::id()
            ));
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(f) => break (f, path),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => return Err(at(&path)(e)),
            }
        };
        let mut w = EventWriter { file, path };
        w.write(&Event {
            wall_time: time,
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        })?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write(&mut self, event: &Event) -> Result<(), EventFileError> {
        self.file
            .write_all(&frame(&event.encode_to_vec()))
            .map_err(|source| EventFileError {
                path: self.path.clone(),
                source,
            })
    }

    /// Scalars of one step, as one event.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<(), EventFileError> {
        let value = values
            .iter()
            .map(|(tag, v)| Value {
                tag: tag.to_string(),
                metadata: None,
                payload: Some(Payload::SimpleValue(*v as f32)),
            })
            .collect();
        self.write(&Event {
            wall_time: crate::unix_time(),
            step: step as i64,
            what: Some(What::Summary(Summary { value })),
        })
    }

    /// A text summary (shown by TensorBoard's Text tab, rendered as Markdown).
    pub fn text(&mut self, step: u64, tag: &str, markdown: &str) -> Result<(), EventFileError> {
        let value = Value {
            tag: tag.to_string(),
            metadata: Some(SummaryMetadata {
                plugin_data: Some(PluginData {
                    plugin_name: "text".into(),
                    content: Vec::new(),
                }),
            }),
            payload: Some(Payload::Tensor(TensorProto {
                dtype: DT_STRING,
                tensor_shape: Some(TensorShapeProto {
                    dim: vec![Dim { size: 1 }],
                }),
                string_val: vec![markdown.as_bytes().to_vec()],
            })),
        };
        self.write(&Event {
            wall_time: crate::unix_time(),
            step: step as i64,
            what: Some(What::Summary(Summary { value: vec![value] })),
        })
    }

    /// Marks a (re)start at `step`: TensorBoard drops what earlier files recorded after it.
    pub fn session_start(&mut self, step: u64) -> Result<(), EventFileError> {
        self.write(&Event {
            wall_time: crate::unix_time(),
            step: step as i64,
            what: Some(What::SessionLog(SessionLog {
                status: SESSION_START,
            })),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TFRecord's layout; that TensorBoard accepts the checksums is proven by its own reader
    /// (tests/cli/telemetry.rs).
    #[test]
    fn frame_matches_tensorflow() {
        let record = frame(b"hello");
        assert_eq!(&record[..8], &5u64.to_le_bytes());
        assert_eq!(&record[12..17], b"hello");
        assert_eq!(record.len(), 8 + 4 + 5 + 4);
        // CRC-32C (Castagnoli) of "hello", masked as TFRecord masks it.
        assert_eq!(crc32c::crc32c(b"hello"), 0x9a71_bb4c);
        assert_eq!(
            u32::from_le_bytes(record[17..21].try_into().unwrap()),
            0x9a71_bb4c_u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }

    #[test]
    fn events_round_trip_through_prost() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(3, &[("train/loss", 2.5)]).unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let mut events = Vec::new();
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            let len = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
            events.push(Event::decode(&rest[12..12 + len]).unwrap());
            rest = &rest[16 + len..];
        }
        assert_eq!(
            events[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        let Some(What::Summary(s)) = &events[1].what else {
            panic!("{:?}", events[1])
        };
        assert_eq!(events[1].step, 3);
        assert_eq!(s.value[0].payload, Some(Payload::SimpleValue(2.5)));
    }
}
