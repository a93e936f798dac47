//! What the DPM accepts from its callers, whoever they are (decision 0005, "Size limits"):
//! the bounds on metadata names, values and entries, on a KN's registered endpoint and on a
//! ListMetadata answer, and the checks that apply them.
//!
//! The size checks here run on the request as it arrived, before any lock is taken (the
//! service calls them before its blocking work, and [`crate::Dpm`] again at its own entry), so
//! an oversized request is refused without waiting for or holding anything. Only the entry
//! count needs the metadata itself; it is checked under the metadata lock, where a new name
//! is added.
//!
//! Names the DPM writes itself (`dpm/`, `cell/`) are not bound by these limits: their sizes
//! follow from other bounds (KN ids, key sizes), and callers cannot write them.
//! docs/operations.md ("Limits") lists the same numbers.

use crate::error::{DpmError, Result};

/// Longest metadata name a caller may write, in bytes (ASCII only).
pub const MAX_METADATA_NAME: usize = 256;
/// Largest metadata value a caller may write, except the two below.
pub const MAX_METADATA_VALUE: usize = 64 << 10;
/// Largest `cluster/map` and `cluster/reconfiguration` value: under the DPM's 16 MiB decoding
/// limit, with room for a CompareAndPutMetadata that carries both `expected` and `value`.
pub const MAX_CLUSTER_VALUE: usize = 8 << 20;
/// Most metadata entries (all of them, the DPM's own included) once a caller adds one.
pub const MAX_METADATA_ENTRIES: usize = 65_536;
/// Longest `RegisterKn.endpoint`, in bytes (a DNS name is at most 253, plus ":port").
pub const MAX_ENDPOINT: usize = 255;
/// Most bytes of names and values in one ListMetadata answer (tonic's default decoding limit
/// on the caller's side is 4 MiB).
pub const MAX_LIST_BYTES: usize = 4 << 20;
/// The response header set when a ListMetadata answer stops at [`MAX_LIST_BYTES`]: the name of
/// the first entry left out (the answer holds every matching entry before it, in name order).
pub const LIST_TRUNCATED_HEADER: &str = "dinomo-list-truncated-at";

/// Most ranges in one ForwardWrites call (a shard forwards one batch, or its cells).
pub const MAX_FORWARDED_RANGES: usize = 64;

/// The names whose values may reach [`MAX_CLUSTER_VALUE`].
const LARGE_VALUE_NAMES: [&str; 2] = ["cluster/map", "cluster/reconfiguration"];

/// The largest value a caller may store under `name`.
pub fn max_value_len(name: &str) -> usize {
    if LARGE_VALUE_NAMES.contains(&name) {
        MAX_CLUSTER_VALUE
    } else {
        MAX_METADATA_VALUE
    }
}

/// Checks the ranges of a ForwardWrites call: at most [`MAX_FORWARDED_RANGES`], none empty,
/// each inside the pool (`pool_len` bytes), no more than a segment (`segment_size`) in all. A
/// KN forwards one log batch (at most a segment) or a few cells per call; the handler copies
/// what it is given into the backups' queues on a runtime worker, so one call stays small.
pub fn check_forwarded_ranges(
    ranges: impl ExactSizeIterator<Item = (u64, u64)>,
    pool_len: u64,
    segment_size: u64,
) -> Result<Vec<(u64, u64)>> {
    if ranges.len() > MAX_FORWARDED_RANGES {
        return Err(DpmError::InvalidArgument(format!(
            "{} ranges in one ForwardWrites call: at most {MAX_FORWARDED_RANGES}",
            ranges.len()
        )));
    }
    let ranges: Vec<(u64, u64)> = ranges.collect();
    let total = ranges
        .iter()
        .try_fold(0u64, |sum, &(_, len)| sum.checked_add(len));
    if total.is_none_or(|t| t > segment_size) {
        return Err(DpmError::InvalidArgument(format!(
            "forwarded ranges of more than a segment ({segment_size} B) in all: a call \
             forwards one log batch or a few cells"
        )));
    }
    ranges
        .into_iter()
        .map(|(offset, len)| {
            let inside = offset.checked_add(len).is_some_and(|end| end <= pool_len);
            if len == 0 || !inside {
                return Err(DpmError::InvalidArgument(format!(
                    "forwarded range [{offset}, +{len}) is empty or outside the pool \
                     ({pool_len} B)"
                )));
            }
            Ok((offset, len))
        })
        .collect()
}

/// Checks the sizes of a metadata write (PutMetadata or CompareAndPutMetadata; `expected` is
/// bounded like the value, as it must equal one written under the same bound).
pub fn check_metadata_write(
    name: &str,
    value: Option<&[u8]>,
    expected: Option<&[u8]>,
) -> Result<()> {
    if name.len() > MAX_METADATA_NAME || !name.is_ascii() {
        return Err(DpmError::InvalidArgument(format!(
            "metadata name of {} bytes starting {:?}: names are ASCII of at most \
             {MAX_METADATA_NAME} bytes",
            name.len(),
            name.chars().take(32).collect::<String>()
        )));
    }
    let cap = max_value_len(name);
    for (what, v) in [("value", value), ("expected value", expected)] {
        if let Some(v) = v {
            if v.len() > cap {
                return Err(DpmError::InvalidArgument(format!(
                    "metadata {name:?}: the {what} is {} bytes, over the {cap}-byte limit for \
                     this name",
                    v.len()
                )));
            }
        }
    }
    Ok(())
}

/// Refuses a caller's write that would add a name (`exists`: it is there already; `sets`: a
/// value is written, not a delete) to metadata holding `entries` entries, at or beyond
/// [`MAX_METADATA_ENTRIES`]. A replacement or a delete always fits. Runs under the metadata
/// lock (it needs the entries).
pub fn check_room(entries: usize, exists: bool, name: &str, sets: bool) -> Result<()> {
    if sets && !exists && entries >= MAX_METADATA_ENTRIES {
        return Err(DpmError::MetadataFull {
            name: name.to_string(),
            entries,
        });
    }
    Ok(())
}

/// Checks a KN's `RegisterKn.endpoint`: at most [`MAX_ENDPOINT`] bytes, `HOST:PORT` or
/// `[IPV6]:PORT` with a decimal port (0 included: an in-process KN that serves no gRPC
/// registers with port 0) and a host of letters, digits, `.`, `-` and `_`.
pub fn check_endpoint(endpoint: &str) -> Result<()> {
    let bad = |why: &str| {
        Err(DpmError::InvalidArgument(format!(
            "KN endpoint {:?} {why}; it must be HOST:PORT, at most {MAX_ENDPOINT} bytes",
            endpoint.chars().take(64).collect::<String>()
        )))
    };
    if endpoint.len() > MAX_ENDPOINT {
        return bad(&format!("is {} bytes", endpoint.len()));
    }
    let (host, port) = if let Some(rest) = endpoint.strip_prefix('[') {
        let Some((ip, after)) = rest.split_once("]:") else {
            return bad("has no ']:PORT' after its IPv6 address");
        };
        if ip.parse::<std::net::Ipv6Addr>().is_err() {
            return bad("has no valid IPv6 address inside [..]");
        }
        (None, after)
    } else {
        let Some((host, port)) = endpoint.rsplit_once(':') else {
            return bad("has no port");
        };
        (Some(host), port)
    };
    if let Some(host) = host {
        let ok = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_');
        if host.is_empty() || !host.bytes().all(ok) {
            return bad("has no valid host");
        }
    }
    match port.parse::<u16>() {
        Ok(_) if port.bytes().all(|b| b.is_ascii_digit()) => Ok(()),
        _ => bad("has no valid port (0-65535)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(r: Result<()>) -> String {
        match r {
            Err(DpmError::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn forwarded_ranges_are_inside_the_pool_and_at_most_a_segment() {
        let check = |r: Vec<(u64, u64)>| check_forwarded_ranges(r.into_iter(), 1 << 20, 4096);
        assert_eq!(check(vec![(0, 2048), (1_044_480, 2048)]).unwrap().len(), 2);
        for bad in [(0, 0), ((1 << 20) - 8, 16), (u64::MAX - 4, 8)] {
            let m = refused(check(vec![bad]).map(|_| ()));
            assert!(m.contains("outside the pool"), "{bad:?}: {m}");
        }
        for bad in [
            vec![(0, 4097)],
            vec![(0, 4096), (1_044_480, 8)],
            vec![(0, u64::MAX), (0, 2)],
        ] {
            let m = refused(check(bad.clone()).map(|_| ()));
            assert!(m.contains("in all"), "{bad:?}: {m}");
        }
        let m = refused(check(vec![(0, 8); MAX_FORWARDED_RANGES + 1]).map(|_| ()));
        assert!(m.contains("at most 64"), "{m}");
    }

    #[test]
    fn metadata_names_are_short_ascii() {
        check_metadata_write(&"n".repeat(MAX_METADATA_NAME), Some(b"v"), None).unwrap();
        let m = refused(check_metadata_write(
            &"n".repeat(MAX_METADATA_NAME + 1),
            Some(b"v"),
            None,
        ));
        assert!(m.contains("257 bytes"), "{m}");
        refused(check_metadata_write("caf\u{e9}", Some(b"v"), None));
    }

    #[test]
    fn metadata_values_are_bounded_by_name() {
        let small = vec![0u8; MAX_METADATA_VALUE];
        let over = vec![0u8; MAX_METADATA_VALUE + 1];
        check_metadata_write("monitor/endpoint", Some(&small), None).unwrap();
        let m = refused(check_metadata_write("monitor/endpoint", Some(&over), None));
        assert!(m.contains("65537 bytes"), "{m}");
        refused(check_metadata_write("x", None, Some(&over)));
        for name in ["cluster/map", "cluster/reconfiguration"] {
            check_metadata_write(name, Some(&over), Some(&over)).unwrap();
            let big = vec![0u8; MAX_CLUSTER_VALUE + 1];
            refused(check_metadata_write(name, Some(&big), None));
            refused(check_metadata_write(name, None, Some(&big)));
        }
        // A delete carries no value.
        check_metadata_write("x", None, None).unwrap();
    }

    #[test]
    fn metadata_entries_are_bounded() {
        let full = MAX_METADATA_ENTRIES;
        check_room(full - 1, false, "new", true).unwrap();
        assert!(matches!(
            check_room(full, false, "new", true),
            Err(DpmError::MetadataFull { entries, .. }) if entries == full
        ));
        // Replacing or deleting an entry adds none.
        check_room(full, true, "old", true).unwrap();
        check_room(full, true, "old", false).unwrap();
        check_room(full, false, "absent", false).unwrap();
    }

    #[test]
    fn endpoints_are_host_and_port() {
        for ok in [
            "127.0.0.1:7801",
            "kv-0.dinomo-kv.default.svc.cluster.local:7800",
            "[::1]:7801",
            "host_name:1",
            "127.0.0.1:0",
        ] {
            check_endpoint(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [
            "",
            "x",
            "host",
            ":7801",
            "host:65536",
            "host:+80",
            "host:",
            "http://host:80",
            "a b:80",
            "::1:80",
            "[::1]",
            "[zz]:80",
        ] {
            refused(check_endpoint(bad));
        }
        let long = format!("{}:80", "h".repeat(MAX_ENDPOINT - 3));
        check_endpoint(&long).unwrap();
        let m = refused(check_endpoint(&format!("h{long}")));
        assert!(m.contains("256 bytes"), "{m}");
    }
}
