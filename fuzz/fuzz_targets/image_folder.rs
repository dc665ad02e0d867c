//! The image-folder scan over trees the input describes: one entry a line, `PATH/` a folder,
//! `PATH=TEXT` a file holding TEXT (`\n` for a newline), so val_annotations.txt and words.txt
//! are fuzzed where the scan reads them. Never a panic, and every image it would read lies
//! inside the data set's folder.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::{Component, Path};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let dir = tempfile::tempdir().unwrap();
    for line in text.lines().take(64) {
        let (path, content) = line.split_once('=').unwrap_or((line, ""));
        let relative = Path::new(path.trim_end_matches('/'));
        if path.is_empty()
            || path.len() > 200
            || !relative.components().all(|c| matches!(c, Component::Normal(_)))
        {
            continue;
        }
        let target = dir.path().join(relative);
        if path.ends_with('/') {
            let _ = std::fs::create_dir_all(&target);
        } else {
            if let Some(parent) = target.parent() {
                let _ = std::fs::create_dir_all(parent);
            }
            let _ = std::fs::write(&target, content.replace("\\n", "\n"));
        }
    }
    if let Ok(files) = trainer::fuzzing::image_folder(dir.path()) {
        for file in files {
            assert!(
                file.starts_with(dir.path())
                    && file
                        .strip_prefix(dir.path())
                        .unwrap()
                        .components()
                        .all(|c| matches!(c, Component::Normal(_))),
                "{file:?} is outside {:?}",
                dir.path()
            );
        }
    }
});
