//! Fetching tiny-imagenet-200: the official archive (Stanford CS231n), checked against its
//! published size and MD5, extracted into a staging folder and renamed into place, so a
//! crash or a second node never leaves half a data set where the trainer looks.

use std::io::Read;
use std::path::Path;

use super::folder::{Layout, TINY_DIR};
use crate::cifar::{Archive, DataProgress};
use crate::error::{IoContext, Result, TrainError};

pub const OFFICIAL_URL: &str = "http://cs231n.stanford.edu/tiny-imagenet-200.zip";
/// As the data set loaders of ContinualAI/avalanche (benchmarks/datasets/tiny_imagenet) and
/// others check it.
pub const OFFICIAL_MD5: &str = "90528d7ca1a48142e341f4ef8d21d0de";
/// 248,100,043 bytes, as torchvision's download progress reports it (`248100043/248100043`).
pub const OFFICIAL_SIZE: u64 = 248_100_043;

/// tiny-imagenet-200's archive.
pub(crate) const TINY: Archive = Archive {
    what: "tiny-imagenet-200",
    file: "tiny-imagenet-200.zip",
    folder: TINY_DIR,
    unpack,
    present: |dir| Layout::locate(dir).is_some(),
};

/// The zip at `archive` into the folder `staging`. Entries whose names would leave it are
/// refused.
fn unpack(archive: &Path, staging: &Path, progress: &mut dyn FnMut(DataProgress)) -> Result<()> {
    let bad = |problem: String| TrainError::BadData {
        path: archive.to_path_buf(),
        problem: format!("cannot extract: {problem}"),
    };
    let file = std::fs::File::open(archive).at(archive)?;
    let total = file.metadata().at(archive)?.len();
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file))
        .map_err(|e| bad(format!("not a zip archive ({e})")))?;
    let mut done = 0u64;
    let mut buf = vec![0u8; 256 * 1024];
    for i in 0..zip.len() {
        let mut entry = zip.by_index(i).map_err(|e| bad(e.to_string()))?;
        let Some(name) = entry.enclosed_name() else {
            return Err(bad(format!(
                "entry {:?} would be written outside the folder",
                entry.name()
            )));
        };
        let target = staging.join(name);
        if entry.is_dir() {
            std::fs::create_dir_all(&target).at(&target)?;
            continue;
        }
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).at(parent)?;
        }
        let mut out = std::fs::File::create(&target).at(&target)?;
        loop {
            let n = entry
                .read(&mut buf)
                .map_err(|e| bad(format!("{}: {e}", target.display())))?;
            if n == 0 {
                break;
            }
            std::io::Write::write_all(&mut out, &buf[..n]).at(&target)?;
        }
        let before = done;
        done += entry.compressed_size();
        if done / (1 << 20) != before / (1 << 20) {
            progress(DataProgress::Extracting { done, total });
        }
    }
    progress(DataProgress::Extracting { done: total, total });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cifar::extract;
    use std::io::Write;

    fn zip_of(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let mut out = std::io::Cursor::new(Vec::new());
        {
            let mut w = zip::ZipWriter::new(&mut out);
            for (name, data) in entries {
                w.start_file(*name, zip::write::SimpleFileOptions::default())
                    .unwrap();
                w.write_all(data).unwrap();
            }
            w.finish().unwrap();
        }
        out.into_inner()
    }

    #[test]
    fn an_archive_is_extracted_whole_and_escaping_entries_refused() {
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join("a.zip");
        std::fs::write(
            &archive,
            zip_of(&[
                ("tiny-imagenet-200/wnids.txt", b"n01\n"),
                ("tiny-imagenet-200/train/n01/images/n01_0.JPEG", b"x"),
            ]),
        )
        .unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir_all(&data).unwrap();
        extract(&archive, &data, &TINY, &mut |_| {}).unwrap();
        assert!(
            data.join("tiny-imagenet-200/train/n01/images/n01_0.JPEG")
                .is_file()
        );
        assert_eq!(
            std::fs::read_dir(&data).unwrap().count(),
            1,
            "no staging left"
        );

        std::fs::write(&archive, zip_of(&[("../evil.txt", b"x")])).unwrap();
        let other = dir.path().join("other");
        std::fs::create_dir_all(&other).unwrap();
        let err = extract(&archive, &other, &TINY, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains("outside the folder"), "{err}");
        assert!(!dir.path().join("evil.txt").exists());
        assert_eq!(
            std::fs::read_dir(&other).unwrap().count(),
            0,
            "nothing left behind"
        );

        std::fs::write(&archive, b"PK not a zip").unwrap();
        let err = extract(&archive, &other, &TINY, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a zip archive"), "{err}");
    }
}
