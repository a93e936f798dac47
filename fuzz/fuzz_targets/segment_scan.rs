//! See `dinomo_fuzz::segment_scan` for the input format and what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dinomo_fuzz::segment_scan(data));
