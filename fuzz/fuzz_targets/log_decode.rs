//! See `dinomo_fuzz::log_decode` for the input format and what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dinomo_fuzz::log_decode(data));
