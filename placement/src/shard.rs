//! The local ring (paper §3.4): which shard (worker) inside a KN owns a key.
//!
//! The global ring gives each KN a set of arcs of the key-hash circle, i.e. keys whose hashes
//! share ranges of their *high* bits. Deriving the shard from the same hash bits would pile one
//! KN's keys onto a few shards, so the shard is taken from a scrambled copy of the hash: the
//! key hash is XORed with [`SHARD_SALT`], passed through the SplitMix64 finalizer (a bijection
//! with full avalanche), and mapped onto `0..shards` with a multiply-shift
//! (`(mixed * shards) >> 64`), which is unbiased to within `shards / 2^64`.
//!
//! Only the owning KN uses this mapping, but every process that asks "which shard" must agree
//! with the KN (tests, tooling), so the salt, the finalizer and the multiply-shift are a stable
//! format like the vnode positions. Changing `shards_per_kn` reshuffles keys between a KN's
//! shards (it is not a consistent-hash ring); that is fine because shards only partition a KN's
//! caches and log writers, and a KN restarts its shards when it takes a new map.
//!
//! Invariant: `shard_of_hash(h, s) < s` for every `s >= 1`; `s == 0` is treated as 1.

/// XORed into the key hash before scrambling, so shard choice is decorrelated from ring
/// position even for hashes that happen to be small ("DNMSHARD" in ASCII).
pub const SHARD_SALT: u64 = u64::from_le_bytes(*b"DNMSHARD");

/// The shard in `0..shards` that owns a key with hash `key_hash` inside its KN.
pub fn shard_of_hash(key_hash: u64, shards: u32) -> u32 {
    let shards = u64::from(shards.max(1));
    let mixed = splitmix64_finalize(key_hash ^ SHARD_SALT);
    ((u128::from(mixed) * u128::from(shards)) >> 64) as u32
}

/// The SplitMix64 output function: a bijection on u64 where every input bit affects every
/// output bit.
fn splitmix64_finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn zero_shards_means_one() {
        assert_eq!(shard_of_hash(12345, 0), 0);
        assert_eq!(shard_of_hash(u64::MAX, 1), 0);
    }

    #[test]
    fn pinned_values() {
        // Recorded when the format was fixed; a change here reshuffles every KN's shards.
        let got: Vec<u32> = [0u64, 1, 0xdead_beef, u64::MAX]
            .iter()
            .map(|&h| shard_of_hash(h, 16))
            .collect();
        assert_eq!(got, PINNED_16);
    }

    const PINNED_16: [u32; 4] = [14, 3, 0, 10];

    proptest! {
        #[test]
        fn always_in_range(h in any::<u64>(), s in 1u32..=4096) {
            prop_assert!(shard_of_hash(h, s) < s);
        }
    }
}
