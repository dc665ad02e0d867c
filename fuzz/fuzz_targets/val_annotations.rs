//! tiny-imagenet's `val_annotations.txt`: never a panic, and no accepted file name reaches
//! outside `val/images/`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(lines) = trainer::fuzzing::val_annotations(&text) {
        for (file, _) in lines {
            assert!(!file.is_empty() && !file.contains('/') && !file.contains(".."));
        }
    }
});
