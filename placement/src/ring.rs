//! The consistent-hash ring with virtual nodes (paper §3.4, "global hash ring").
//!
//! The ring is the circle of 64-bit key hashes ([`crate::key_hash`]). Every node places
//! `vnodes` points on it; a key hash `h` belongs to the node of the first point at or after `h`
//! clockwise (wrapping past `u64::MAX` to the smallest point). So a point at position `p` owns
//! the arc `(previous point, p]`.
//!
//! # Vnode positions are a cluster-wide format
//!
//! Clients, routing nodes, KNs and the monitor each build the ring on their own from the same
//! cluster map, so they only agree on owners if every process derives the same positions. The
//! position of virtual node `v` of node `n` is
//!
//! ```text
//! position(n, v) = xxh3_64(seed 0) of the 20 bytes
//!     "DNMVNODE"                      8 bytes, ASCII tag (VNODE_TAG)
//!     n.ring_id()  as u64, little-endian   8 bytes
//!     v            as u32, little-endian   4 bytes
//! ```
//!
//! computed with [`dinomo_layout::key_hash`]. Changing the tag, the field widths, their order
//! or the hash changes which KN owns which key and needs a new cluster-map format version.
//!
//! # Invariants
//!
//! - Points are sorted by `(position, node)` and contain exactly `vnodes` points per distinct
//!   node, so the ring depends only on the *set* of nodes and `vnodes`, never on the order the
//!   nodes were given in.
//! - Two points at the same position (a 64-bit collision, practically never) are resolved
//!   deterministically: the smaller node owns the arc, the other point owns an empty arc.
//! - Adding a node only moves keys *to* it; removing a node only moves keys *from* it.

use std::fmt::Debug;
use std::hash::Hash;

/// The ASCII tag that starts the encoding hashed into a vnode position (see the module doc).
pub const VNODE_TAG: [u8; 8] = *b"DNMVNODE";

/// A node id that can be placed on a [`HashRing`].
///
/// `ring_id` is the value encoded into vnode positions (see the module doc). It must be
/// injective (two distinct nodes never share a `ring_id`) and stable across processes and
/// builds: it is part of the cluster-wide placement format. It is a separate trait, rather
/// than `std::hash::Hash`, because `Hash` output is neither specified nor stable.
pub trait RingNode: Copy + Ord + Hash + Debug {
    /// The stable 64-bit identity of this node on the ring.
    fn ring_id(self) -> u64;
}

macro_rules! ring_node_for_unsigned {
    ($($t:ty),*) => {$(
        impl RingNode for $t {
            fn ring_id(self) -> u64 {
                u64::from(self)
            }
        }
    )*};
}
ring_node_for_unsigned!(u8, u16, u32, u64);

/// The ring position of virtual node `vnode` of the node whose [`RingNode::ring_id`] is
/// `node_ring_id`. Cluster-wide format: see the module doc.
pub fn vnode_position(node_ring_id: u64, vnode: u32) -> u64 {
    let mut buf = [0u8; 20];
    buf[..8].copy_from_slice(&VNODE_TAG);
    buf[8..16].copy_from_slice(&node_ring_id.to_le_bytes());
    buf[16..20].copy_from_slice(&vnode.to_le_bytes());
    dinomo_layout::key_hash(&buf)
}

/// A consistent-hash ring over nodes of type `N` with `vnodes` virtual nodes per node.
///
/// Immutable: membership changes build a new ring (cheap: `nodes x vnodes` hashes and a sort).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HashRing<N: RingNode> {
    /// Point positions, ascending (ties broken by node, see `owners_at`).
    positions: Vec<u64>,
    /// `owners_at[i]` is the node of the point at `positions[i]`.
    owners_at: Vec<N>,
    /// The distinct nodes, ascending.
    nodes: Vec<N>,
    vnodes: u32,
}

impl<N: RingNode> HashRing<N> {
    /// Builds the ring of `nodes` (duplicates are ignored, order does not matter) with `vnodes`
    /// points per node. `vnodes == 0` or no nodes gives an empty ring that owns nothing.
    pub fn new(nodes: impl IntoIterator<Item = N>, vnodes: u32) -> Self {
        let mut distinct: Vec<N> = nodes.into_iter().collect();
        distinct.sort_unstable();
        distinct.dedup();

        let mut points: Vec<(u64, N)> =
            Vec::with_capacity(distinct.len().saturating_mul(vnodes as usize));
        for &node in &distinct {
            let id = node.ring_id();
            points.extend((0..vnodes).map(|v| (vnode_position(id, v), node)));
        }
        // Sorting by (position, node) makes the result independent of input order, including
        // the tie-break on colliding positions.
        points.sort_unstable();

        let (positions, owners_at) = points.into_iter().unzip();
        HashRing {
            positions,
            owners_at,
            nodes: distinct,
            vnodes,
        }
    }

    /// The node owning `key_hash`, or `None` for an empty ring.
    pub fn owner(&self, key_hash: u64) -> Option<N> {
        self.successor(key_hash).map(|i| self.owners_at[i])
    }

    /// The first `n` distinct nodes clockwise from `key_hash`: the owner first, then the nodes
    /// that would inherit the key one after another. Fewer than `n` if the ring has fewer
    /// nodes. Used to pick replica owners.
    pub fn owners(&self, key_hash: u64, n: usize) -> Vec<N> {
        let want = n.min(self.nodes.len());
        let mut out = Vec::with_capacity(want);
        let Some(start) = self.successor(key_hash) else {
            return out;
        };
        let len = self.positions.len();
        for step in 0..len {
            if out.len() == want {
                break;
            }
            let node = self.owners_at[(start + step) % len];
            if !out.contains(&node) {
                out.push(node);
            }
        }
        out
    }

    /// The distinct nodes on the ring, ascending.
    pub fn nodes(&self) -> &[N] {
        &self.nodes
    }

    /// Virtual nodes per node.
    pub fn vnodes(&self) -> u32 {
        self.vnodes
    }

    /// Number of distinct nodes (a ring with `vnodes == 0` has nodes but no points).
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// True if the ring has no points (no nodes, or `vnodes == 0`).
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// The ring's points `(position, node)` in ascending order. The point at `p` owns the arc
    /// from the previous point (exclusive) to `p` (inclusive); the first point also owns the
    /// wrap-around arc after the last point.
    pub fn points(&self) -> impl ExactSizeIterator<Item = (u64, N)> + '_ {
        self.positions
            .iter()
            .copied()
            .zip(self.owners_at.iter().copied())
    }

    /// The nodes that own a different set of key hashes in `self` and in `next`, ascending.
    ///
    /// Exact, not sampled: the union of both rings' point positions cuts the circle into arcs
    /// on which each ring has a single owner (the owner of the arc's closing point), so
    /// comparing the two owners at every union position covers every key hash. Each arc whose
    /// owner differs contributes both its old and its new owner. O(points of both rings).
    pub fn changed_nodes(&self, next: &HashRing<N>) -> Vec<N> {
        let mut changed: Vec<N> = Vec::new();
        let (a, b) = (&self.positions, &next.positions);
        // ia / ib: index of the first point >= the current boundary in each ring, i.e. exactly
        // what `successor` returns for that boundary, so ties resolve the same way as `owner`.
        let (mut ia, mut ib) = (0usize, 0usize);
        loop {
            let boundary = match (a.get(ia), b.get(ib)) {
                (Some(&pa), Some(&pb)) => pa.min(pb),
                (Some(&pa), None) => pa,
                (None, Some(&pb)) => pb,
                (None, None) => break,
            };
            let old = self.owner_from(ia);
            let new = next.owner_from(ib);
            if old != new {
                changed.extend(old);
                changed.extend(new);
            }
            // Move both cursors past every point at this boundary.
            while a.get(ia).is_some_and(|&p| p == boundary) {
                ia += 1;
            }
            while b.get(ib).is_some_and(|&p| p == boundary) {
                ib += 1;
            }
        }
        changed.sort_unstable();
        changed.dedup();
        changed
    }

    /// Index of the point owning `key_hash`: the first point at or after it, wrapping to 0.
    fn successor(&self, key_hash: u64) -> Option<usize> {
        if self.positions.is_empty() {
            return None;
        }
        let i = self.positions.partition_point(|&p| p < key_hash);
        Some(if i == self.positions.len() { 0 } else { i })
    }

    /// The owner of the point at index `i`, wrapping past the end to the first point.
    fn owner_from(&self, i: usize) -> Option<N> {
        self.owners_at
            .get(i)
            .or_else(|| self.owners_at.first())
            .copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn keys(n: usize, salt: u64) -> Vec<u64> {
        (0..n as u64)
            .map(|i| crate::key_hash(format!("key-{salt}-{i}").as_bytes()))
            .collect()
    }

    #[test]
    fn vnode_position_encoding_is_pinned() {
        // The documented encoding, built by hand: a change here is a cluster-wide format change.
        let mut buf = Vec::new();
        buf.extend_from_slice(b"DNMVNODE");
        buf.extend_from_slice(&7u64.to_le_bytes());
        buf.extend_from_slice(&3u32.to_le_bytes());
        assert_eq!(vnode_position(7, 3), dinomo_layout::key_hash(&buf));
        assert_eq!(vnode_position(7, 3), PINNED_7_3);
    }

    /// xxh3-64 (seed 0) of the 20 bytes for node 7, vnode 3, recorded when the format was fixed.
    const PINNED_7_3: u64 = 6_233_328_098_211_194_007;

    #[test]
    fn empty_ring_owns_nothing() {
        let r: HashRing<u32> = HashRing::new([], 64);
        assert!(r.is_empty());
        assert_eq!(r.owner(42), None);
        assert!(r.owners(42, 3).is_empty());
        let r0 = HashRing::new([1u32, 2], 0);
        assert!(r0.is_empty());
        assert_eq!(r0.owner(42), None);
        assert_eq!(r0.node_count(), 2);
    }

    #[test]
    fn single_node_owns_everything_including_wraparound() {
        let r = HashRing::new([9u32], 4);
        for h in [0, 1, u64::MAX / 2, u64::MAX] {
            assert_eq!(r.owner(h), Some(9));
        }
        assert_eq!(r.owners(5, 3), vec![9]);
    }

    #[test]
    fn owner_is_successor_point() {
        let r = HashRing::new([1u32, 2, 3], 8);
        let pts: Vec<(u64, u32)> = r.points().collect();
        for w in pts.windows(2) {
            assert!(w[0] <= w[1]);
        }
        // Exactly at a point and just after the previous one: that point's node.
        for (i, &(p, n)) in pts.iter().enumerate() {
            assert_eq!(r.owner(p), Some(n));
            let prev = if i == 0 {
                pts[pts.len() - 1].0
            } else {
                pts[i - 1].0
            };
            if prev != p {
                assert_eq!(r.owner(prev.wrapping_add(1)), Some(n));
            }
        }
        // Past the last point wraps to the first.
        let last = pts[pts.len() - 1].0;
        if last != u64::MAX {
            assert_eq!(r.owner(u64::MAX), Some(pts[0].1));
        }
    }

    #[test]
    fn duplicate_nodes_are_ignored() {
        assert_eq!(
            HashRing::new([1u32, 2, 2, 1, 3], 16),
            HashRing::new([3u32, 2, 1], 16)
        );
    }

    #[test]
    fn balance_with_64_vnodes_fixed_ids() {
        // The common deployment shape: KN ids 0..n with the minimum vnodes the design allows.
        for n in 3u32..=8 {
            let r = HashRing::new(0..n, 64);
            let mut counts = vec![0usize; n as usize];
            let ks = keys(20_000, u64::from(n));
            for &h in &ks {
                counts[r.owner(h).unwrap() as usize] += 1;
            }
            let fair = ks.len() as f64 / f64::from(n);
            for (node, &c) in counts.iter().enumerate() {
                let ratio = c as f64 / fair;
                assert!(
                    (0.5..=1.5).contains(&ratio),
                    "n={n} node {node} owns {ratio:.3}x its fair share"
                );
            }
        }
    }

    #[test]
    fn changed_nodes_identical_rings_is_empty() {
        let a = HashRing::new([1u32, 2, 3], 32);
        assert!(a.changed_nodes(&a.clone()).is_empty());
        let e: HashRing<u32> = HashRing::new([], 32);
        assert!(e.changed_nodes(&e).is_empty());
        assert_eq!(e.changed_nodes(&a), vec![1, 2, 3]);
        assert_eq!(a.changed_nodes(&e), vec![1, 2, 3]);
    }

    fn node_set() -> impl Strategy<Value = Vec<u32>> {
        prop::collection::btree_set(any::<u32>(), 1..12).prop_map(|s| s.into_iter().collect())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn deterministic_in_any_order(
            (nodes, shuffled) in node_set().prop_flat_map(|n| (Just(n.clone()), Just(n).prop_shuffle())),
            vnodes in 1u32..96,
            salt in any::<u64>(),
        ) {
            let a = HashRing::new(nodes.iter().copied(), vnodes);
            // Another order plus duplicates: neither may change the ring.
            let dup = shuffled.iter().copied().chain(nodes.iter().take(2).copied());
            let b = HashRing::new(dup, vnodes);
            prop_assert_eq!(&a, &b);
            for h in keys(500, salt) {
                prop_assert_eq!(a.owner(h), b.owner(h));
                prop_assert_eq!(a.owners(h, 3), b.owners(h, 3));
            }
        }
    }

    proptest! {
        // Balance is statistical: with 64 vnodes a node's exact share of the ring (summed arc
        // lengths) fell outside [0.5, 1.5] x fair for 5 of 110,000 nodes in 20,000 random
        // 3..8-node rings, and for none at 128 or 256 vnodes. A fixed seed keeps this test from
        // flaking on that tail; the inputs are still generated, not hand-picked.
        #![proptest_config(ProptestConfig {
            cases: 64,
            rng_seed: prop::test_runner::RngSeed::Fixed(0x0d19_0b0d_5eed),
            ..ProptestConfig::default()
        })]

        #[test]
        fn balance_64_plus_vnodes(
            nodes in prop::collection::btree_set(any::<u32>(), 3..=8),
            vnodes in 64u32..=256,
            salt in any::<u64>(),
        ) {
            let r = HashRing::new(nodes.iter().copied(), vnodes);
            let ks = keys(20_000, salt);
            let mut counts = std::collections::BTreeMap::<u32, usize>::new();
            for &h in &ks {
                *counts.entry(r.owner(h).unwrap()).or_default() += 1;
            }
            let fair = ks.len() as f64 / nodes.len() as f64;
            for &n in &nodes {
                let ratio = counts.get(&n).copied().unwrap_or(0) as f64 / fair;
                prop_assert!(
                    (0.5..=1.5).contains(&ratio),
                    "node {} owns {:.3}x its fair share ({} nodes, {} vnodes)",
                    n, ratio, nodes.len(), vnodes
                );
            }
        }

    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn adding_a_node_only_moves_keys_to_it(nodes in node_set(), extra in any::<u32>(), vnodes in 1u32..128, salt in any::<u64>()) {
            prop_assume!(!nodes.contains(&extra));
            let before = HashRing::new(nodes.iter().copied(), vnodes);
            let after = HashRing::new(nodes.iter().copied().chain([extra]), vnodes);
            for h in keys(2_000, salt) {
                let (o, n) = (before.owner(h), after.owner(h));
                prop_assert!(o == n || n == Some(extra), "key moved {:?} -> {:?}", o, n);
            }
        }

        #[test]
        fn removing_a_node_only_moves_keys_from_it(nodes in node_set(), pick in any::<prop::sample::Index>(), vnodes in 1u32..128, salt in any::<u64>()) {
            let gone = nodes[pick.index(nodes.len())];
            let before = HashRing::new(nodes.iter().copied(), vnodes);
            let after = HashRing::new(nodes.iter().copied().filter(|&n| n != gone), vnodes);
            for h in keys(2_000, salt) {
                let (o, n) = (before.owner(h), after.owner(h));
                prop_assert!(o == n || o == Some(gone), "key moved {:?} -> {:?}", o, n);
            }
        }

        #[test]
        fn owners_distinct_and_start_with_owner(nodes in node_set(), vnodes in 1u32..64, n in 0usize..16, h in any::<u64>()) {
            let r = HashRing::new(nodes.iter().copied(), vnodes);
            let os = r.owners(h, n);
            prop_assert_eq!(os.len(), n.min(nodes.len()));
            let distinct: BTreeSet<u32> = os.iter().copied().collect();
            prop_assert_eq!(distinct.len(), os.len());
            if n > 0 {
                prop_assert_eq!(os.first().copied(), r.owner(h));
            }
            // A prefix property: asking for fewer gives a prefix of asking for more.
            prop_assert_eq!(&r.owners(h, n + 1)[..os.len()], &os[..]);
            // The second owner is who inherits the key when the owner leaves.
            if os.len() >= 2 {
                let without = HashRing::new(nodes.iter().copied().filter(|&x| x != os[0]), vnodes);
                prop_assert_eq!(without.owner(h), Some(os[1]));
            }
        }

        #[test]
        fn changed_nodes_matches_brute_force(
            a in node_set(), b in node_set(), va in 1u32..48, vb in 1u32..48, salt in any::<u64>(),
        ) {
            let ra = HashRing::new(a.iter().copied(), va);
            let rb = HashRing::new(b.iter().copied(), vb);
            let changed: BTreeSet<u32> = ra.changed_nodes(&rb).into_iter().collect();
            // Brute force over every boundary of both rings plus sampled hashes.
            let probes = ra.points().chain(rb.points()).map(|(p, _)| p)
                .chain(keys(2_000, salt)).chain([0, u64::MAX]);
            let mut expected = BTreeSet::new();
            for h in probes {
                let (o, n) = (ra.owner(h), rb.owner(h));
                if o != n {
                    expected.extend(o);
                    expected.extend(n);
                }
            }
            // Boundaries cover every arc, so brute force over them is exact too.
            prop_assert_eq!(&changed, &expected);
        }
    }
}
