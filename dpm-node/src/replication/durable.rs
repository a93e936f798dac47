//! Writing the small files kept beside a pool (`<pool>.term`, `<pool>.role`, `<pool>.copy`)
//! so that a crash leaves either the old contents or the new, whole, and making their
//! removal durable.

use std::path::{Path, PathBuf};

use crate::error::Result;

/// Writes `text` to `path` so that, after a crash, `path` holds either its old contents or
/// `text`, whole: a temporary file, synced, renamed over `path`, then the directory synced.
pub(super) fn write_durably(path: &Path, text: &str) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".new");
    let tmp = PathBuf::from(tmp);
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    sync_dir_of(path);
    Ok(())
}

/// Syncs the directory holding `path` (so that a rename or removal in it is durable).
pub(super) fn sync_dir_of(path: &Path) {
    if let Some(dir) = path.parent() {
        if let Ok(d) = std::fs::File::open(if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        }) {
            let _ = d.sync_all();
        }
    }
}
