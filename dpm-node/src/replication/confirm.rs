//! Telling a backup that its copy is complete (the CopyComplete call), until it hears.
//!
//! A refusal (FAILED_PRECONDITION: the backup is attached to another copy or a newer primary
//! now) is final. Anything else (the backup unreachable, a timeout, a backup running a
//! dpm-node older than the call) is tried again, with a backoff from 200 ms to 5 s, for as
//! long as the caller waits: until it hears, the backup stays catching-up, counted by barriers
//! and not promotable. Giving up would fail a healthy backup for good after a network blip, or
//! for the length of a rolling upgrade.

use std::future::Future;
use std::time::Duration;

const FIRST_RETRY: Duration = Duration::from_millis(200);
const MAX_RETRY: Duration = Duration::from_secs(5);

/// Runs `call` until it succeeds (`Ok`) or the backup at `backup` refuses (`Err`, why).
pub(crate) async fn until_heard<F, Fut>(backup: &str, mut call: F) -> Result<(), String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), tonic::Status>>,
{
    let mut backoff = FIRST_RETRY;
    loop {
        let why = match call().await {
            Ok(()) => return Ok(()),
            Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                return Err(format!("CopyComplete at {backup}: {}", s.message()))
            }
            Err(s) if s.code() == tonic::Code::Unimplemented => format!(
                "{backup} runs a dpm-node without CopyComplete (older than this primary): \
                 upgrade the backups first"
            ),
            Err(s) => format!("CopyComplete at {backup}: {}", s.message()),
        };
        tracing::warn!(%backup, error = %why, retry_in = ?backoff, "could not tell the backup its copy is complete: it stays catching-up (not promotable) until it hears");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_RETRY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::Mutex;

    /// Answers the calls from `script` in order; how many calls were made.
    async fn run(script: Vec<Result<(), tonic::Status>>) -> (Result<(), String>, usize) {
        let script = Mutex::new(VecDeque::from(script));
        let calls = Mutex::new(0);
        let r = until_heard("b:1", || {
            *calls.lock().unwrap() += 1;
            let next = script
                .lock()
                .unwrap()
                .pop_front()
                .expect("a scripted answer");
            async move { next }
        })
        .await;
        let n = *calls.lock().unwrap();
        (r, n)
    }

    #[tokio::test]
    async fn transient_errors_and_an_old_backup_are_tried_again_until_it_hears() {
        let (r, calls) = run(vec![
            Err(tonic::Status::unavailable("connection refused")),
            Err(tonic::Status::unimplemented("no such method")),
            Err(tonic::Status::deadline_exceeded("timeout")),
            Ok(()),
        ])
        .await;
        assert_eq!((r, calls), (Ok(()), 4));
    }

    #[tokio::test]
    async fn a_refusal_is_final() {
        let (r, calls) = run(vec![
            Err(tonic::Status::unavailable("connection refused")),
            Err(tonic::Status::failed_precondition(
                "copy 3 is not the copy in progress",
            )),
            Ok(()),
        ])
        .await;
        let why = r.unwrap_err();
        assert!(why.contains("b:1") && why.contains("copy 3"), "{why}");
        assert_eq!(calls, 2, "nothing is tried after a refusal");
    }
}
