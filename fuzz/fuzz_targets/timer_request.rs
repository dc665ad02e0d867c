//! File-timer requests from the workers' named pipe: any bytes are read or refused without a
//! panic, and what is read names a real pid and a finite deadline.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = launcher::timer::parse(data) {
        assert!(r.pid > 0 && r.expiration.is_finite());
        assert!(r.scope.chars().count() <= 200);
    }
});
