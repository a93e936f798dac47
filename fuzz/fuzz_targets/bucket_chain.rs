//! See `dinomo_fuzz::bucket_chain` for the input format and what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dinomo_fuzz::bucket_chain(data));
