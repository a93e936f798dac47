//! Reading the DPM's index and log entries with one-sided READs (DINOMO's read path).
//!
//! Invariants relied on (see dinomo_layout::index): every slot word is read atomically; an
//! entry is trusted only after its CRC and full key check out (and, for shortcuts, its
//! version); a bucket deeper than the reader's view was split under it, so the reader follows
//! its key to the deeper home bucket (and re-reads the shape on its next lookup).

use bytes::Bytes;
use dinomo_fabric::{Fabric, FabricExt, Op};
use dinomo_layout::index::{
    next_home, Bucket, EntryPtr, IndexHeader, Shape, BUCKET_SIZE, INDEX_HEADER_SIZE,
};
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

/// A cached view of the index: its header, shape and the chunk directory words read so far.
#[derive(Debug)]
pub struct RemoteIndex {
    root_word: u64,
    view: Option<(u64, IndexHeader, Shape)>,
    /// Whether a lookup found the shape stale (a split happened): re-read it next time.
    stale: bool,
    /// Directory words read so far (0: not read, or the chunk did not exist then).
    chunks: Vec<u64>,
}

/// Bound on view refreshes in one lookup (a split storm would be a bug, not load).
const MAX_REFRESHES: usize = 8;
/// Bound on bucket reads in one lookup: chains are short; a cycle would be a corrupt pool.
const MAX_BUCKET_READS: usize = 4096;

impl RemoteIndex {
    pub fn new(root_word: u64) -> Self {
        RemoteIndex {
            root_word,
            view: None,
            stale: false,
            chunks: Vec::new(),
        }
    }

    /// The header and shape, read (1 READ, 2 the first time) when unknown or stale.
    async fn view(&mut self, f: &dyn Fabric) -> KvResult<(IndexHeader, Shape)> {
        if let Some((_, h, s)) = self.view.filter(|_| !self.stale) {
            return Ok((h, s));
        }
        let header_off = match self.view {
            Some((off, _, _)) => off,
            None => {
                let root = f.read(self.root_word, 8).await?;
                u64::from_le_bytes(root[..8].try_into().expect("8 bytes"))
            }
        };
        let head = f.read(header_off, INDEX_HEADER_SIZE as u32).await?;
        let (h, s) = IndexHeader::decode_with_shape(&head)
            .map_err(|e| KvError::Internal(format!("index header: {e}")))?;
        self.view = Some((header_off, h, s));
        self.stale = false;
        Ok((h, s))
    }

    /// Pool offset of home bucket `b`, reading its chunk's directory word if not known yet.
    async fn bucket_off(
        &mut self,
        f: &dyn Fabric,
        h: &IndexHeader,
        b: u64,
    ) -> KvResult<Option<u64>> {
        let (chunk, within) = h.locate(b);
        let j = chunk as usize;
        if chunk >= h.max_chunks {
            return Ok(None);
        }
        if self.chunks.len() <= j {
            self.chunks.resize(j + 1, 0);
        }
        if self.chunks[j] == 0 {
            let w = f.read(h.directory_word(chunk), 8).await?;
            self.chunks[j] = u64::from_le_bytes(w[..8].try_into().expect("8 bytes"));
        }
        Ok((self.chunks[j] != 0).then(|| self.chunks[j] + within))
    }

    /// The merged value of `key`, if any. See dinomo_layout::index for why following bucket
    /// depths makes this correct while the DPM splits buckets.
    pub async fn lookup(&mut self, f: &dyn Fabric, key: &[u8]) -> KvResult<Option<Fetched>> {
        let hash = dinomo_layout::key_hash(key);
        'refresh: for attempt in 0..MAX_REFRESHES {
            if attempt > 0 {
                self.stale = true;
            }
            let (h, shape) = self.view(f).await?;
            let (mut b, mut depth) = shape.home(hash);
            let Some(mut off) = self.bucket_off(f, &h, b).await? else {
                continue 'refresh;
            };
            for _ in 0..MAX_BUCKET_READS {
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
                let bucket = Bucket::decode(&raw)
                    .map_err(|e| KvError::Internal(format!("index bucket: {e}")))?;
                let Some(bucket_depth) = bucket.depth().filter(|&d| d >= depth) else {
                    // Not a bucket of the table as this view describes it: re-read the view.
                    continue 'refresh;
                };
                if bucket_depth > depth {
                    // Split since the view was read: follow the key to its deeper home.
                    self.stale = true;
                    match next_home(hash, b, depth, bucket_depth) {
                        Some((nb, nd)) => {
                            (b, depth) = (nb, nd);
                            match self.bucket_off(f, &h, b).await? {
                                Some(o) => off = o,
                                None => continue 'refresh,
                            }
                            continue;
                        }
                        None => depth = bucket_depth,
                    }
                }
                for (_, ptr) in bucket.candidates(hash) {
                    if let Some(e) = read_entry(f, ptr, key).await? {
                        return Ok((e.op == LogOp::Put).then_some(e));
                    }
                    // Same 64-bit hash but not this key's entry: almost surely the slot moved
                    // on (the entry was overwritten, cleaned, its segment freed and reused)
                    // between the bucket READ and the entry READ. Look again, unless this is
                    // the last try (then it is a true hash collision and the walk goes on).
                    if attempt + 1 < MAX_REFRESHES {
                        continue 'refresh;
                    }
                }
                if bucket.next == 0 {
                    return Ok(None);
                }
                off = bucket.next;
            }
            return Err(KvError::Internal(
                "an index chain did not end (corrupt pool?)".into(),
            ));
        }
        Err(KvError::Internal(
            "the index kept changing during a lookup".into(),
        ))
    }
}
