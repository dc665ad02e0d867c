//! S3 keys from a listing (network input) turned into paths under the staging folder: never a
//! panic, and an accepted key lands strictly inside the folder, on plain names only.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::{Component, Path};

fuzz_target!(|data: &[u8]| {
    let key = String::from_utf8_lossy(data);
    let dir = Path::new("/stage/into");
    if let Ok(path) = objects::fuzzing::stage_path(dir, &key) {
        let inside = path.strip_prefix(dir).expect("under the folder");
        assert!(inside.components().count() > 0);
        assert!(inside.components().all(|c| matches!(c, Component::Normal(_))));
    }
});
