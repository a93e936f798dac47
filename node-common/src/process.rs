//! This process as other processes on the same host see it.

/// The inode of this process's pid namespace (`/proc/self/ns/pid`): two processes can compare
/// pids only if these are equal.
pub fn pid_namespace() -> Option<u64> {
    // "pid:[4026531836]"
    let link = std::fs::read_link("/proc/self/ns/pid").ok()?;
    let s = link.to_str()?;
    s.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_has_a_pid_namespace() {
        assert!(super::pid_namespace().is_some_and(|n| n > 0));
    }
}
