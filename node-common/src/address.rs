//! The addresses a node hands to others, and the identity a pod's name gives it.
//!
//! A node listens on one address and is reached at another: `0.0.0.0:7800` is where a KV node
//! in a container listens, `dinomo-kn-2.dinomo-kn.prod.svc:7800` or `10.0.3.7:7800` is what
//! clients must dial. [`advertise_address`] picks the second: the operator's `--advertise`
//! when given, the listen address when it is a real one, and the address the host's name
//! resolves to when the node listens on a wildcard (a pod's or a container's name resolves to
//! its own IP through /etc/hosts; the bare name does not resolve from other hosts, so the IP
//! is what is handed out); never the wildcard itself, which other hosts would dial as their
//! own loopback.

use std::net::{SocketAddr, ToSocketAddrs};

/// This host's name (the kernel's, as `hostname` prints it).
pub fn host_name() -> Option<String> {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())?;
    let h = h.trim();
    (!h.is_empty()).then(|| h.to_string())
}

/// The address other hosts should dial to reach a server listening on `listen`.
///
/// `advertise` (a flag or config value; empty = none) wins: `HOST:PORT`, or `HOST` alone for
/// the listen port. Otherwise the listen address, unless it is a wildcard (0.0.0.0 or ::):
/// then the first address this host's name resolves to that is not loopback (nor a wildcard),
/// with the listen port. The error says what to set.
pub fn advertise_address(
    what: &str,
    listen: SocketAddr,
    advertise: &str,
) -> Result<String, String> {
    let advertise = advertise.trim();
    if !advertise.is_empty() {
        return with_port(what, advertise, listen.port());
    }
    if !listen.ip().is_unspecified() {
        return Ok(listen.to_string());
    }
    let Some(host) = host_name() else {
        return Err(format!(
            "{what}: listening on the wildcard {listen} and this host has no name to \
             advertise instead; set the address other hosts reach it at (--advertise HOST:PORT)"
        ));
    };
    let reachable = (host.as_str(), listen.port())
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.find(|a| !a.ip().is_loopback() && !a.ip().is_unspecified()));
    match reachable {
        Some(a) => Ok(a.to_string()),
        None => Err(format!(
            "{what}: listening on the wildcard {listen}, and this host's name {host:?} does not \
             resolve to an address other hosts can reach; set the address to advertise \
             (--advertise HOST:PORT)"
        )),
    }
}

/// `s` as `HOST:PORT` (adding `port` to a bare host), or why it is not one.
fn with_port(what: &str, s: &str, port: u16) -> Result<String, String> {
    let bad = |why: &str| Err(format!("{what}: advertise address {s:?} {why}"));
    if s.contains("://") || s.contains('/') {
        return bad("must be HOST:PORT, without a scheme or path");
    }
    // A bracketed IPv6 address, with or without a port.
    if let Some(rest) = s.strip_prefix('[') {
        let Some((ip, after)) = rest.split_once(']') else {
            return bad("has an unclosed '['");
        };
        match ip.parse::<std::net::Ipv6Addr>() {
            Err(_) => return bad("has no valid IPv6 address inside [..]"),
            Ok(a) if a.is_unspecified() => {
                return bad("is a wildcard, which other hosts cannot dial")
            }
            Ok(_) => {}
        }
        return match after {
            "" => Ok(format!("[{ip}]:{port}")),
            p => match p.strip_prefix(':').map(str::parse::<u16>) {
                Some(Ok(p)) if p != 0 => Ok(s.to_string()),
                _ => bad("has no valid port after ']:'"),
            },
        };
    }
    let (host, p) = match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => (h, Some(p)),
        Some(_) => return bad("looks like an IPv6 address: write it as [ADDR]:PORT"),
        None => (s, None),
    };
    if host.is_empty() {
        return bad("has no host");
    }
    if host
        .parse::<std::net::Ipv4Addr>()
        .is_ok_and(|a| a.is_unspecified())
    {
        return bad("is a wildcard, which other hosts cannot dial");
    }
    match p.map(str::parse::<u16>) {
        None => Ok(format!("{host}:{port}")),
        Some(Ok(p)) if p != 0 => Ok(s.to_string()),
        Some(_) => bad("has no valid port (1-65535)"),
    }
}

/// The ordinal of a StatefulSet pod, from its name `{statefulset}-{ordinal}` (the host name
/// of the pod), or why there is none.
pub fn ordinal_from_name(name: &str) -> Result<u32, String> {
    let digits = name.rsplit_once('-').map(|(_, d)| d).unwrap_or("");
    if digits.is_empty()
        || !digits.bytes().all(|b| b.is_ascii_digit())
        || (digits.len() > 1 && digits.starts_with('0'))
    {
        return Err(format!(
            "{name:?} does not end in -<ordinal> as a StatefulSet pod's name does"
        ));
    }
    digits
        .parse()
        .map_err(|_| format!("the ordinal of {name:?} is too large"))
}

/// The ports this host's kernel hands to outgoing connections (`net.ipv4.ip_local_port_range`;
/// Linux's default, 32768-60999, when it cannot be read).
///
/// A server that must get its port back after a restart should listen outside them: any
/// connection a client on the host opens may take a free port of this range as its own, and
/// once it closes, its TIME_WAIT holds the port for a minute, during which no listener can bind
/// it (`SO_REUSEADDR` does not help: the client's socket did not set it).
pub fn ephemeral_ports() -> std::ops::RangeInclusive<u16> {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| parse_port_range(&s))
        .unwrap_or(32768..=60999)
}

/// A base port such that `base + o` is free on 127.0.0.1 right now for every offset `o`
/// (offsets within +-30000), outside [`ephemeral_ports`] and above 10000, for a set of local
/// servers that may be restarted on their ports (`dinomo up`'s tests, `dinomo scenario`'s KV
/// nodes). Seen in CI before this: a dpm-node backup restarted after a failover could not
/// listen on its port for 62 s, held by a client connection's TIME_WAIT. On a host whose
/// ephemeral range leaves no room (e.g. 1024-65535), any free base above 10000, with that risk.
/// "Free" is a bind with `SO_REUSEADDR` (tokio's and std's listeners set it), so a port whose
/// own listener's TIME_WAIT is pending counts as free, as it is for the node. `None` when 200
/// random tries found nothing.
pub fn free_port_base(offsets: &[i32]) -> Option<u16> {
    let ephemeral = ephemeral_ports();
    let (first, last) = (*offsets.iter().min()?, *offsets.iter().max()?);
    if first < -30_000 || last > 30_000 {
        return None;
    }
    // Bases whose ports all lie in 10000..ephemeral, or above it; the base itself a port too.
    let span =
        |low: i32, high: i32| Some(((low - first).max(0), high - last)).filter(|(a, b)| a <= b);
    let mut spans: Vec<(i32, i32)> = [
        span(10_000, i32::from(*ephemeral.start()) - 1),
        span(i32::from(*ephemeral.end()) + 1, 65_535),
    ]
    .into_iter()
    .flatten()
    .collect();
    if spans.is_empty() {
        spans.extend(span(10_000, 65_535));
    }
    if spans.is_empty() {
        return None;
    }
    for _ in 0..200 {
        let (a, b) = spans[rand::random_range(0..spans.len())];
        let base = rand::random_range(a..=b);
        let free = offsets.iter().all(|o| {
            u16::try_from(base + o)
                .is_ok_and(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        });
        if free {
            return u16::try_from(base).ok();
        }
    }
    None
}

/// `"32768\t60999\n"` (the file's format) as a range.
fn parse_port_range(s: &str) -> Option<std::ops::RangeInclusive<u16>> {
    let mut it = s.split_whitespace().map(str::parse::<u16>);
    let (low, high) = (it.next()?.ok()?, it.next()?.ok()?);
    (low <= high && it.next().is_none()).then_some(low..=high)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_real_listen_address_is_advertised_as_is() {
        assert_eq!(
            advertise_address("kv-node", addr("10.1.2.3:7800"), "").unwrap(),
            "10.1.2.3:7800"
        );
    }

    #[test]
    fn advertise_wins_and_takes_the_listen_port_when_it_has_none() {
        let l = addr("0.0.0.0:7800");
        assert_eq!(
            advertise_address("kv-node", l, "kn-0.kn.svc:7900").unwrap(),
            "kn-0.kn.svc:7900"
        );
        assert_eq!(
            advertise_address("kv-node", l, "kn-0.kn.svc").unwrap(),
            "kn-0.kn.svc:7800"
        );
        assert_eq!(
            advertise_address("kv-node", l, "[fd00::7]").unwrap(),
            "[fd00::7]:7800"
        );
        assert_eq!(
            advertise_address("kv-node", l, "[fd00::7]:1").unwrap(),
            "[fd00::7]:1"
        );
    }

    #[test]
    fn bad_advertise_addresses_are_refused_with_the_reason() {
        let l = addr("0.0.0.0:7800");
        for (bad, why) in [
            ("http://x:1", "scheme"),
            ("x:0", "valid port"),
            ("x:http", "valid port"),
            (":7800", "no host"),
            ("0.0.0.0:7800", "wildcard"),
            ("[::]:7800", "wildcard"),
            ("[::]", "wildcard"),
            ("fd00::7", "IPv6"),
            ("[fd00::7", "unclosed"),
        ] {
            let e = advertise_address("kv-node", l, bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
            assert!(e.starts_with("kv-node: "), "{e}");
        }
    }

    #[test]
    fn a_wildcard_is_never_advertised() {
        // This host's name may or may not resolve here; either way no wildcard comes out.
        for l in ["0.0.0.0:7800", "[::]:7800"] {
            match advertise_address("kv-node", addr(l), "") {
                Ok(a) => {
                    assert!(!a.starts_with("0.0.0.0") && !a.starts_with("[::]"), "{a}");
                    assert!(a.ends_with(":7800"), "{a}");
                }
                Err(e) => assert!(e.contains("--advertise"), "{e}"),
            }
        }
    }

    #[test]
    fn the_ephemeral_port_range_is_read_as_the_kernel_writes_it() {
        assert_eq!(parse_port_range("32768\t60999\n"), Some(32768..=60999));
        assert_eq!(parse_port_range("1024 65535"), Some(1024..=65535));
        for bad in ["", "32768", "60999 32768", "a b", "1 2 3", "1 70000"] {
            assert_eq!(parse_port_range(bad), None, "{bad:?}");
        }
        let r = ephemeral_ports();
        assert!(r.start() <= r.end());
    }

    #[test]
    fn a_free_port_base_keeps_every_port_outside_the_ephemeral_range() {
        let ephemeral = ephemeral_ports();
        // Room for the span below or above the range (as on Linux's default 32768-60999);
        // otherwise any base above 10000 is allowed.
        let room = *ephemeral.start() > 10_000 + 2300 || *ephemeral.end() < 65_535 - 2300;
        let offsets = [-100, 0, 1, 20, 2200];
        for _ in 0..20 {
            let base = free_port_base(&offsets).expect("a free base");
            for o in offsets {
                let p = u16::try_from(i32::from(base) + o).unwrap();
                assert!(p >= 10_000, "{p}");
                assert!(!room || !ephemeral.contains(&p), "{p} in {ephemeral:?}");
            }
        }
        let high = free_port_base(&[20_000]).expect("a base for a high offset");
        assert!(i32::from(high) + 20_000 <= 65_535);
        assert_eq!(free_port_base(&[]), None);
        assert_eq!(free_port_base(&[0, 40_000]), None);
    }

    #[test]
    fn ordinals_come_from_statefulset_pod_names() {
        assert_eq!(ordinal_from_name("dinomo-kn-0"), Ok(0));
        assert_eq!(ordinal_from_name("dinomo-kn-12"), Ok(12));
        for bad in ["dinomo-kn", "dinomo-kn-", "dinomo-kn-01", "kn-x1", "7"] {
            assert!(ordinal_from_name(bad).is_err(), "{bad}");
        }
    }
}
