//! The one conformance suite that every backend must pass. A backend's test provides a
//! [`Harness`] (how to connect a caller with a write window, revoke it or shrink its window,
//! and look at the memory node's bytes directly) and calls [`run_all`]. The same suite runs on
//! shm and tcp in `cargo test` and on verbs inside the Soft-RoCE VM (scripts/vm-tests.sh), all
//! nine cases on every backend.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use crate::error::FabricError;
use crate::fault::{FaultPlan, Faulty};
use crate::grants::WindowRange;
use crate::op::{AccessKey, Completion, Op};
use crate::{Fabric, FabricExt};

/// What a backend offers to the suite.
#[async_trait]
pub trait Harness: Send + Sync {
    /// Region length in bytes (at least 4 MiB).
    fn region_len(&self) -> u64;
    /// Grants a fresh key whose write window is `window` and connects a caller with it.
    async fn connect_with(
        &self,
        window: &[WindowRange],
    ) -> crate::Result<(Box<dyn Fabric>, AccessKey)>;
    /// Grants a fresh key that may write the whole region and connects a caller with it.
    async fn connect(&self) -> crate::Result<(Box<dyn Fabric>, AccessKey)> {
        self.connect_with(&[WindowRange::write(0, self.region_len())])
            .await
    }
    /// Revokes a key at the memory node.
    fn revoke(&self, key: AccessKey);
    /// Removes the window range starting at `offset` from `key`'s window at the memory node
    /// (a sealed segment); when it returns, no post may be acknowledged under the old window.
    fn close_window(&self, key: AccessKey, offset: u64);
    /// Reads the memory node's bytes directly (not through the fabric).
    fn local_read(&self, offset: u64, len: usize) -> Vec<u8>;
}

type Failure = String;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(format!($($fmt)*));
        }
    };
}

fn pattern(len: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<_>>(),
    )
}

/// Runs every case; returns the names of the cases run, or the first failure.
pub async fn run_all(h: &dyn Harness) -> Result<Vec<&'static str>, Failure> {
    let mut ran = Vec::new();
    macro_rules! case {
        ($name:literal, $f:expr) => {
            $f.await.map_err(|e| format!("{}: {}", $name, e))?;
            ran.push($name);
        };
    }
    case!("write_read_sizes", write_read_sizes(h));
    case!("batched_post_is_one_round_trip", batched_post(h));
    case!("cas_returns_old_value", cas_semantics(h));
    case!("faa_returns_old_value_and_is_atomic", faa_atomic(h));
    case!("bad_posts_are_refused_whole", bad_posts(h));
    case!("revoked_key_is_fenced", revocation(h));
    case!("pipelined_posts", pipelined(h));
    case!("torn_write_applies_exact_prefix", torn_write(h));
    case!("writes_only_inside_the_window", write_windows(h));
    Ok(ran)
}

async fn write_read_sizes(h: &dyn Harness) -> Result<(), Failure> {
    let (f, _) = h.connect().await.map_err(|e| e.to_string())?;
    let mut off = 4096u64;
    for (i, len) in [1usize, 7, 8, 63, 64, 65, 4096, 4097, 1 << 20]
        .into_iter()
        .enumerate()
    {
        let data = pattern(len, i as u8);
        f.write(off + i as u64, data.clone())
            .await
            .map_err(|e| e.to_string())?;
        let back = f
            .read(off + i as u64, len as u32)
            .await
            .map_err(|e| e.to_string())?;
        ensure!(back == data, "read back of {len} bytes differs");
        let local = h.local_read(off + i as u64, len);
        ensure!(
            local == data[..],
            "memory node does not hold the {len} written bytes"
        );
        off += len as u64 + 128;
    }
    Ok(())
}

async fn batched_post(h: &dyn Harness) -> Result<(), Failure> {
    let (f, _) = h.connect().await.map_err(|e| e.to_string())?;
    let before = f.stats().snapshot();
    let ops = [
        Op::Write {
            offset: 2 << 20,
            data: pattern(100, 1),
        },
        Op::Write {
            offset: (2 << 20) + 100,
            data: pattern(28, 2),
        },
        Op::Read {
            offset: 2 << 20,
            len: 128,
        },
        Op::Faa {
            offset: (2 << 20) + 256,
            add: 3,
        },
    ];
    let cs = f.post(&ops).await.map_err(|e| e.to_string())?;
    ensure!(cs.len() == 4, "expected 4 completions, got {}", cs.len());
    let mut want = pattern(100, 1).to_vec();
    want.extend_from_slice(&pattern(28, 2));
    ensure!(
        cs[2] == Completion::Read(Bytes::from(want)),
        "READ after WRITEs in one post must see them"
    );
    let d = f.stats().snapshot().since(&before);
    ensure!(
        d.round_trips == 1,
        "one post must count one round trip, counted {}",
        d.round_trips
    );
    ensure!(
        d.writes == 2 && d.reads == 1 && d.faa == 1,
        "op counts wrong: {d:?}"
    );
    ensure!(
        d.bytes_written == 128 && d.bytes_read == 128,
        "byte counts wrong: {d:?}"
    );
    Ok(())
}

async fn cas_semantics(h: &dyn Harness) -> Result<(), Failure> {
    let (f, _) = h.connect().await.map_err(|e| e.to_string())?;
    let at = 3 << 20;
    f.write(at, Bytes::copy_from_slice(&5u64.to_le_bytes()))
        .await
        .map_err(|e| e.to_string())?;
    let old = f.cas(at, 4, 9).await.map_err(|e| e.to_string())?;
    ensure!(
        old == 5,
        "failed CAS must return the current value 5, got {old}"
    );
    let old = f.cas(at, 5, 9).await.map_err(|e| e.to_string())?;
    ensure!(
        old == 5,
        "successful CAS must return the old value 5, got {old}"
    );
    let now = u64::from_le_bytes(h.local_read(at, 8).try_into().expect("8"));
    ensure!(now == 9, "CAS did not store the new value (found {now})");
    Ok(())
}

async fn faa_atomic(h: &dyn Harness) -> Result<(), Failure> {
    let at = (3 << 20) + 64;
    let mut callers = Vec::new();
    for _ in 0..4 {
        callers.push(Arc::new(h.connect().await.map_err(|e| e.to_string())?.0));
    }
    callers[0]
        .write(at, Bytes::copy_from_slice(&0u64.to_le_bytes()))
        .await
        .map_err(|e| e.to_string())?;
    let mut tasks = Vec::new();
    for f in &callers {
        let f = f.clone();
        tasks.push(tokio::spawn(async move {
            let mut olds = Vec::new();
            for _ in 0..200 {
                olds.push(f.faa(at, 1).await.map_err(|e| e.to_string())?);
            }
            Ok::<_, String>(olds)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.map_err(|e| e.to_string())??);
    }
    all.sort_unstable();
    ensure!(
        all == (0..800).collect::<Vec<u64>>(),
        "FAA old values must be exactly 0..800 once each"
    );
    let now = u64::from_le_bytes(h.local_read(at, 8).try_into().expect("8"));
    ensure!(now == 800, "after 800 FAAs the word is {now}");
    Ok(())
}

async fn bad_posts(h: &dyn Harness) -> Result<(), Failure> {
    let (f, _) = h.connect().await.map_err(|e| e.to_string())?;
    let len = h.region_len();
    let at = 3 << 20;
    let before = h.local_read(at, 8);
    let r = f
        .post(&[
            Op::Write {
                offset: at,
                data: pattern(8, 7),
            },
            Op::Read {
                offset: len - 4,
                len: 8,
            },
        ])
        .await;
    ensure!(
        matches!(r, Err(FabricError::OutOfBounds { .. })),
        "out-of-bounds READ: {r:?}"
    );
    ensure!(
        h.local_read(at, 8) == before,
        "a refused post must not apply its earlier WRITE"
    );
    let r = f.cas(at + 3, 0, 1).await;
    ensure!(
        matches!(r, Err(FabricError::Misaligned { .. })),
        "misaligned CAS: {r:?}"
    );
    let r = f.faa(len, 1).await;
    ensure!(
        matches!(r, Err(FabricError::OutOfBounds { .. })),
        "FAA past the end: {r:?}"
    );
    // The handle still works after refused posts.
    f.read(0, 8)
        .await
        .map_err(|e| format!("after errors: {e}"))?;
    Ok(())
}

async fn revocation(h: &dyn Harness) -> Result<(), Failure> {
    let (f, key) = h.connect().await.map_err(|e| e.to_string())?;
    let (other, _) = h.connect().await.map_err(|e| e.to_string())?;
    f.read(0, 8).await.map_err(|e| e.to_string())?;
    h.revoke(key);
    let r = f.write(3 << 20, pattern(8, 1)).await;
    ensure!(r.is_err(), "a revoked caller's WRITE must fail");
    if let Err(e) = &r {
        ensure!(
            e.is_permanent(),
            "revocation must be a permanent error, got {e}"
        );
    }
    other
        .read(0, 8)
        .await
        .map_err(|e| format!("another caller must keep access: {e}"))?;
    Ok(())
}

async fn pipelined(h: &dyn Harness) -> Result<(), Failure> {
    let (f, _) = h.connect().await.map_err(|e| e.to_string())?;
    let f: Arc<dyn Fabric> = Arc::from(f);
    let base = 1u64 << 21;
    let mut tasks = Vec::new();
    for i in 0..64u64 {
        let f = f.clone();
        tasks.push(tokio::spawn(async move {
            let data = pattern(256, i as u8);
            f.write(base + i * 256, data.clone())
                .await
                .map_err(|e| e.to_string())?;
            let back = f
                .read(base + i * 256, 256)
                .await
                .map_err(|e| e.to_string())?;
            if back != data {
                return Err(format!("post {i} read back other bytes"));
            }
            Ok(())
        }));
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}

async fn torn_write(h: &dyn Harness) -> Result<(), Failure> {
    let (f, _) = h.connect().await.map_err(|e| e.to_string())?;
    let f = Faulty::new(f);
    let at = (3 << 20) + 4096;
    let zeros = Bytes::from(vec![0u8; 512]);
    for k in [0usize, 1, 63, 64, 200, 511] {
        f.write(at, zeros.clone())
            .await
            .map_err(|e| e.to_string())?;
        f.set_plan(FaultPlan {
            tear_next_write_after: Some(k),
            ..Default::default()
        });
        let data = pattern(512, 9);
        let r = f.write(at, data.clone()).await;
        ensure!(r.is_err(), "a torn WRITE must report an error");
        let local = h.local_read(at, 512);
        ensure!(
            local[..k] == data[..k],
            "the first {k} bytes must be written"
        );
        ensure!(
            local[k..].iter().all(|&b| b == 0),
            "nothing past byte {k} may be written"
        );
    }
    f.set_plan(FaultPlan {
        fail_next: 1,
        ..Default::default()
    });
    ensure!(
        f.read(0, 8).await.is_err(),
        "fail_next must fail the next post"
    );
    f.read(0, 8).await.map_err(|e| e.to_string())?;
    Ok(())
}

/// Where the window case puts things (in a region of at least 4 MiB): the caller's open
/// segment, another caller's segment, the cell space, and bytes that stand for the index.
const SEG: u64 = 3 << 20;
const SEG_LEN: u64 = 64 << 10;
const OTHER_SEG: u64 = SEG + (128 << 10);
const CELLS: u64 = SEG + (256 << 10);
const CELLS_LEN: u64 = 4096;
const INDEX_AREA: u64 = 1 << 20;

fn outside(r: &crate::Result<impl std::fmt::Debug>, what: &str) -> Result<(), Failure> {
    ensure!(
        matches!(r, Err(FabricError::OutsideWindow { .. })),
        "{what} must fail with OutsideWindow, got {r:?}"
    );
    Ok(())
}

async fn write_windows(h: &dyn Harness) -> Result<(), Failure> {
    let (f, key) = h
        .connect_with(&[
            WindowRange::write(SEG, SEG_LEN),
            WindowRange::atomic(CELLS, CELLS_LEN),
        ])
        .await
        .map_err(|e| e.to_string())?;
    let (_g, _) = h
        .connect_with(&[WindowRange::write(OTHER_SEG, SEG_LEN)])
        .await
        .map_err(|e| e.to_string())?;
    // Inside the open segment: applied.
    let data = pattern(4096, 3);
    f.write(SEG + 64, data.clone())
        .await
        .map_err(|e| e.to_string())?;
    ensure!(
        h.local_read(SEG + 64, 4096) == data[..],
        "a WRITE inside the window must land"
    );
    f.write(SEG + SEG_LEN - 8, pattern(8, 4))
        .await
        .map_err(|e| format!("a WRITE ending at the window's end: {e}"))?;
    // Outside: refused, with the bytes unchanged.
    for (what, at, len) in [
        ("a WRITE at offset 0 (superblock)", 0, 64),
        ("a WRITE in the index area", INDEX_AREA, 64),
        ("a WRITE in another caller's segment", OTHER_SEG, 64),
        ("a WRITE straddling the window's end", SEG + SEG_LEN - 8, 16),
        ("a WRITE in the cell space", CELLS, 8),
    ] {
        let before = h.local_read(at, len);
        let r = f.write(at, pattern(len, 5)).await;
        outside(&r, what)?;
        ensure!(h.local_read(at, len) == before, "{what} changed bytes");
    }
    // A post with one WRITE outside is refused whole.
    let before = h.local_read(SEG + 8192, 8);
    let r = f
        .post(&[
            Op::Write {
                offset: SEG + 8192,
                data: pattern(8, 6),
            },
            Op::Write {
                offset: INDEX_AREA,
                data: pattern(8, 6),
            },
        ])
        .await;
    outside(&r, "a post with one WRITE outside")?;
    ensure!(
        h.local_read(SEG + 8192, 8) == before,
        "a refused post must not apply its WRITE inside the window"
    );
    // CAS: in the cell space only (and the segment); FAA: never in the cell space.
    let old = f.cas(CELLS + 64, 0, 42).await.map_err(|e| e.to_string())?;
    ensure!(old == 0, "CAS on a fresh cell returned {old}");
    ensure!(
        h.local_read(CELLS + 64, 8) == 42u64.to_le_bytes(),
        "a CAS in the cell space must land"
    );
    let before = h.local_read(INDEX_AREA, 8);
    outside(&f.cas(INDEX_AREA, 0, 1).await, "a CAS in the index area")?;
    outside(
        &f.cas(CELLS + CELLS_LEN, 0, 1).await,
        "a CAS past the cell space",
    )?;
    outside(&f.faa(CELLS + 64, 1).await, "an FAA in the cell space")?;
    outside(&f.faa(INDEX_AREA, 1).await, "an FAA in the index area")?;
    ensure!(
        h.local_read(INDEX_AREA, 8) == before && h.local_read(CELLS + 64, 8) == 42u64.to_le_bytes(),
        "refused atomics changed bytes"
    );
    // READ reaches everything.
    for at in [0, INDEX_AREA, OTHER_SEG, CELLS, h.region_len() - 8] {
        f.read(at, 8)
            .await
            .map_err(|e| format!("a READ at {at} must succeed: {e}"))?;
    }
    // The segment leaves the window while WRITEs race it: each WRITE acknowledged is in place
    // when the removal returns; after it, WRITEs there are refused.
    let f: Arc<dyn Fabric> = Arc::from(f);
    let writer = {
        let f = f.clone();
        tokio::spawn(async move {
            let mut acked = Vec::new();
            for i in 0..(SEG_LEN / 8 - 1) {
                let word = Bytes::copy_from_slice(&(i + 1).to_le_bytes());
                match f.write(SEG + i * 8, word).await {
                    Ok(()) => acked.push(i),
                    Err(_) => break,
                }
            }
            acked
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    h.close_window(key, SEG);
    let snapshot = h.local_read(SEG, SEG_LEN as usize);
    let acked = writer.await.map_err(|e| e.to_string())?;
    for i in acked {
        let at = (i * 8) as usize;
        ensure!(
            snapshot[at..at + 8] == (i + 1).to_le_bytes(),
            "WRITE {i} was acknowledged but not in place when the window closed"
        );
    }
    let before = h.local_read(SEG, 64);
    outside(
        &f.write(SEG, pattern(64, 8)).await,
        "a WRITE after its segment left the window",
    )?;
    ensure!(
        h.local_read(SEG, 64) == before,
        "a refused WRITE changed bytes"
    );
    // The cell space stays.
    f.cas(CELLS + 64, 42, 43)
        .await
        .map_err(|e| format!("the cell space must stay in the window: {e}"))?;
    Ok(())
}
