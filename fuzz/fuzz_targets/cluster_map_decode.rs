//! See `dinomo_fuzz::cluster_map_decode` for the input format and what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dinomo_fuzz::cluster_map_decode(data));
