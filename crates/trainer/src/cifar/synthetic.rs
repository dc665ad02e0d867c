//! Small CIFAR-format data sets with structure a CNN learns in a few steps: each class has its
//! own pair of colour (which channels are lit) and stripe orientation, under noise. Written in both official layouts and as an
//! archive shaped like the official binary one.

use std::io::Write;
use std::path::Path;

use super::{BIN_DIR, Dataset, IMAGE_BYTES, NUM_CLASSES};

/// `n` images, classes in rotation, reproducible from `seed`.
pub fn generate(n: usize, seed: u64) -> Dataset {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut noise = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) % 64) as i32 - 32
    };
    let mut out = Dataset::default();
    for i in 0..n {
        let class = i % NUM_CLASSES;
        out.labels.push(class as u8);
        for channel in 0..3 {
            // Colour: each class lights a different mix of channels.
            let base = if (class >> channel) & 1 == 1 { 170 } else { 60 };
            for y in 0..32 {
                for x in 0..32 {
                    // Colours repeat after 8 classes; the orientation tells 8 and 9 apart.
                    let orientation = if class >= 8 { class - 6 } else { class % 2 };
                    let stripe = match orientation {
                        0 => y % 8 < 4,
                        1 => x % 8 < 4,
                        2 => (x + y) % 8 < 4,
                        _ => (x + 32 - y) % 8 < 4,
                    };
                    let v = base + if stripe { 40 } else { -40 } + noise();
                    out.images.push(v.clamp(0, 255) as u8);
                }
            }
        }
    }
    debug_assert_eq!(out.images.len(), n * IMAGE_BYTES);
    out
}

/// Writes `train` as `data_batch_1.bin` and `test` as `test_batch.bin` in `dir`.
pub fn write_binary(dir: &Path, train: &Dataset, test: &Dataset) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("data_batch_1.bin"), binary_bytes(train))?;
    std::fs::write(dir.join("test_batch.bin"), binary_bytes(test))?;
    std::fs::write(dir.join("batches.meta.txt"), super::CLASS_NAMES.join("\n"))?;
    Ok(())
}

pub fn binary_bytes(d: &Dataset) -> Vec<u8> {
    let mut out = Vec::with_capacity(d.len() * (IMAGE_BYTES + 1));
    for i in 0..d.len() {
        out.push(d.labels[i]);
        out.extend_from_slice(d.image(i));
    }
    out
}

/// Writes `train` as `data_batch_1` and `test` as `test_batch` in `dir`, pickled the way the
/// official python files are (protocol 2, numpy array through `_reconstruct`).
pub fn write_python(dir: &Path, train: &Dataset, test: &Dataset) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("data_batch_1"), python_bytes(train))?;
    std::fs::write(dir.join("test_batch"), python_bytes(test))?;
    Ok(())
}

pub fn python_bytes(d: &Dataset) -> Vec<u8> {
    let mut p = vec![0x80, 2, b'}', b'('];
    let short = |p: &mut Vec<u8>, s: &[u8]| {
        p.push(b'U');
        p.push(s.len() as u8);
        p.extend_from_slice(s);
    };
    short(&mut p, b"labels");
    p.extend_from_slice(b"](");
    for &l in &d.labels {
        p.extend_from_slice(&[b'K', l]);
    }
    p.push(b'e');
    short(&mut p, b"data");
    p.extend_from_slice(b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85");
    short(&mut p, b"b");
    p.extend_from_slice(b"\x87R(K\x01");
    p.push(b'J');
    p.extend_from_slice(&(d.len() as u32).to_le_bytes());
    p.push(b'M');
    p.extend_from_slice(&(IMAGE_BYTES as u16).to_le_bytes());
    p.extend_from_slice(b"\x86cnumpy\ndtype\n");
    short(&mut p, b"u1");
    p.extend_from_slice(b"K\x00K\x01\x87R(K\x03");
    short(&mut p, b"|");
    p.extend_from_slice(b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89T");
    p.extend_from_slice(&(d.images.len() as u32).to_le_bytes());
    p.extend_from_slice(&d.images);
    p.extend_from_slice(b"tbu.");
    p
}

/// A `.tar.gz` laid out like the official binary archive (`cifar-10-batches-bin/...`).
pub fn binary_archive(train: &Dataset, test: &Dataset) -> std::io::Result<Vec<u8>> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut tar = tar::Builder::new(gz);
    for (name, bytes) in [
        ("data_batch_1.bin", binary_bytes(train)),
        ("test_batch.bin", binary_bytes(test)),
    ] {
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        tar.append_data(&mut header, format!("{BIN_DIR}/{name}"), &bytes[..])?;
    }
    let mut gz = tar.into_inner()?;
    gz.flush()?;
    gz.finish()
}
