//! Store responses from a hostile server: decode never panics and round-trips.
#![no_main]
use collective::store::Response;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(resp) = Response::decode(data) {
        assert_eq!(Response::decode(&resp.encode()).ok(), Some(resp));
    }
});
