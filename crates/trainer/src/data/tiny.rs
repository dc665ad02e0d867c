//! Fetching tiny-imagenet-200: the official archive (Stanford CS231n), checked against its
//! published size and MD5, extracted into a staging folder and renamed into place, so a
//! crash or a second node never leaves half a data set where the trainer looks.

use super::archive::{Archive, unzip};
use super::folder::{Layout, TINY_DIR};

/// tiny-imagenet-200's archive.
pub(crate) const TINY: Archive = Archive {
    what: contract::TINY_IMAGENET.what,
    file: contract::TINY_IMAGENET.file,
    folder: TINY_DIR,
    unpack: unzip,
    present: |dir| Layout::locate(dir).is_some(),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::archive::extract;
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
