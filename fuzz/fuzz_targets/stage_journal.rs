//! The stage journal (`.trainctl-stage`): any text is read without a panic, and never yields
//! more entries than lines.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    assert!(objects::fuzzing::journal(&text) <= text.lines().count());
});
