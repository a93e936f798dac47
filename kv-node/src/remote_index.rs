//! Reading the DPM's index and log entries with one-sided READs (DINOMO's read path).
//!
//! Invariants relied on (see dinomo_layout::index): every slot word is read atomically; an
//! entry is trusted only after its CRC and full key check out (and, for shortcuts, its
//! version); a RETIRED bucket means the table was replaced, so the root is read again.

use bytes::Bytes;
use dinomo_fabric::{Fabric, FabricExt, Op};
use dinomo_layout::index::{Bucket, EntryPtr, TableHeader, BUCKET_SIZE, TABLE_HEADER_SIZE};
use dinomo_layout::log::{decode_entry, entry_len_from_header, LogOp, ENTRY_HEADER};

use crate::error::{KvError, KvResult};

/// A verified log entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    pub ptr: EntryPtr,
    pub version: u64,
    pub op: LogOp,
    pub value: Bytes,
}

/// READs the entry at `ptr` and returns it if it is intact and holds `key`.
pub async fn read_entry(f: &dyn Fabric, ptr: EntryPtr, key: &[u8]) -> KvResult<Option<Fetched>> {
    let bytes = if ptr.len != 0 {
        f.read(ptr.offset, ptr.len).await?
    } else {
        let head = f.read(ptr.offset, ENTRY_HEADER as u32).await?;
        let Ok(len) = entry_len_from_header(&head) else {
            return Ok(None);
        };
        f.read(ptr.offset, len as u32).await?
    };
    match decode_entry(&bytes) {
        Ok((e, _)) if e.key == key => Ok(Some(Fetched {
            ptr,
            version: e.version,
            op: e.op,
            value: bytes.slice_ref(e.value),
        })),
        _ => Ok(None),
    }
}

/// A cached view of the index's current table.
#[derive(Debug)]
pub struct RemoteIndex {
    root_word: u64,
    table: Option<TableHeader>,
}

/// Bound on table refreshes in one lookup (a resize storm would be a bug, not load).
const MAX_REFRESHES: usize = 8;

impl RemoteIndex {
    pub fn new(root_word: u64) -> Self {
        RemoteIndex {
            root_word,
            table: None,
        }
    }

    async fn table(&mut self, f: &dyn Fabric) -> KvResult<TableHeader> {
        if let Some(t) = self.table {
            return Ok(t);
        }
        let root = f.read(self.root_word, 8).await?;
        let off = u64::from_le_bytes(root[..8].try_into().expect("8 bytes"));
        let head = f.read(off, TABLE_HEADER_SIZE as u32).await?;
        let t = TableHeader::decode(&head)
            .map_err(|e| KvError::Internal(format!("index table header: {e}")))?;
        self.table = Some(t);
        Ok(t)
    }

    /// The merged value of `key`, if any.
    pub async fn lookup(&mut self, f: &dyn Fabric, key: &[u8]) -> KvResult<Option<Fetched>> {
        let hash = dinomo_layout::key_hash(key);
        'refresh: for _ in 0..MAX_REFRESHES {
            let t = self.table(f).await?;
            let mut off = t.home_bucket(hash);
            loop {
                let raw = f
                    .post(&[Op::Read {
                        offset: off,
                        len: BUCKET_SIZE as u32,
                    }])
                    .await?;
                let raw = raw
                    .into_iter()
                    .next()
                    .and_then(|c| c.into_read())
                    .unwrap_or_default();
                let b = Bucket::decode(&raw)
                    .map_err(|e| KvError::Internal(format!("index bucket: {e}")))?;
                if b.is_retired() {
                    self.table = None;
                    continue 'refresh;
                }
                for (_, ptr) in b.candidates(hash) {
                    if let Some(e) = read_entry(f, ptr, key).await? {
                        return Ok((e.op == LogOp::Put).then_some(e));
                    }
                }
                if b.next == 0 {
                    return Ok(None);
                }
                off = b.next;
            }
        }
        Err(KvError::Internal(
            "the index table kept changing during a lookup".into(),
        ))
    }
}
