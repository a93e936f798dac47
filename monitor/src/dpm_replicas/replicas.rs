//! The watcher's calls to the members of the replica set (ReplicaService: Status, Promote,
//! AddBackup), behind [`Replicas`] so that its rounds are tested with scripted members
//! (`watcher_tests.rs`); [`GrpcReplicas`] makes the calls for real, as this process's
//! identity.
//!
//! Invariants every implementation keeps (the watcher's safety rests on them):
//! - a Status that fails, or does not answer within its timeout, is an `Err` saying why: the
//!   plan reads the member as silent;
//! - a Promote's error says what may have happened at the backup: [`PromoteError::Refused`]
//!   (nothing changed there) and [`PromoteError::NotSent`] (no connection) let the watcher
//!   choose another backup of its observation, so an answer that does not say whether the
//!   promotion is under way (ALREADY_EXISTS, no answer) must be [`PromoteError::Unknown`].

use std::time::Duration;

use async_trait::async_trait;
use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
use dinomo_proto::dpm::{
    BackupRequest, PromoteRequest, ReplicaStatusRequest, ReplicaStatusResponse,
};

use super::plan::{MemberStatus, Role, Seen};

/// The calls the watcher makes to the members, each naming the member by its address.
#[async_trait]
pub trait Replicas: Send + Sync {
    /// `addr`'s ReplicaService.Status, as [`super::plan::plan`] reads it, within `timeout`.
    async fn status(&self, addr: &str, timeout: Duration) -> Seen;

    /// Promotes `backup` in place, naming `others` as its backups, after a term no older than
    /// `min_term`.
    async fn promote(
        &self,
        backup: &str,
        others: Vec<String>,
        min_term: u64,
    ) -> Result<(), PromoteError>;

    /// Adds `backup` to `primary`'s set (the call returns once the attach is done or failed).
    async fn add_backup(&self, primary: &str, backup: &str) -> anyhow::Result<()>;
}

/// Why a Promote failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromoteError {
    /// The backup refused it (its copy is not complete, no backups named, ...): nothing
    /// changed there.
    #[error("refused: {0}")]
    Refused(String),
    /// No answer, or an answer that does not say: the promotion may be under way (it goes on
    /// after the caller's deadline).
    #[error("outcome not known: {0}")]
    Unknown(String),
    /// No connection: the call was never sent. A pinned backup is asked again next round;
    /// another is asked again once `failover_after` passed, the other backups in sync first.
    #[error("not sent: {0}")]
    NotSent(String),
}

/// The members reached over gRPC (ReplicaService), as this process's identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcReplicas;

#[async_trait]
impl Replicas for GrpcReplicas {
    async fn status(&self, addr: &str, timeout: Duration) -> Seen {
        let ask = async {
            let s = replica_client(addr, timeout)
                .await?
                .status(ReplicaStatusRequest {})
                .await?
                .into_inner();
            member_status(s)
        };
        match tokio::time::timeout(timeout, ask).await {
            Ok(r) => r.map_err(|e: anyhow::Error| format!("{e:#}")),
            Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
        }
    }

    async fn promote(
        &self,
        backup: &str,
        others: Vec<String>,
        min_term: u64,
    ) -> Result<(), PromoteError> {
        let mut client = replica_client(backup, Duration::from_secs(30))
            .await
            // Not connected: the call was never sent.
            .map_err(|e| PromoteError::NotSent(format!("{e:#}")))?;
        let answer = client
            .promote(PromoteRequest {
                backups: others,
                min_term,
            })
            .await;
        answer.map(drop).map_err(promote_error)
    }

    async fn add_backup(&self, primary: &str, backup: &str) -> anyhow::Result<()> {
        // An attach digests the backup's whole pool first: the primary allows 30 s + 4 s per
        // GiB of pool, and a call given up here would leave the attach half done. 15 minutes
        // covers pools of 200 GiB.
        replica_client(primary, Duration::from_secs(15 * 60))
            .await?
            .add_backup(BackupRequest {
                address: backup.to_string(),
            })
            .await
            .map_err(|s| anyhow::anyhow!("{}", s.message()))?;
        Ok(())
    }
}

/// A Status answer as the plan reads it.
fn member_status(s: ReplicaStatusResponse) -> anyhow::Result<MemberStatus> {
    let role = match s.role.as_str() {
        "primary" => Role::Primary,
        "backup" => Role::Backup,
        other => anyhow::bail!("answers with an unknown role {other:?}"),
    };
    Ok(MemberStatus {
        role,
        term: s.term,
        generation: s.generation,
        copy_complete: s.copy_state == "complete",
        copy_term: s.copy_term,
        backups: s
            .backups
            .into_iter()
            .map(|b| (b.address, b.state))
            .collect(),
        // Empty: nothing to say (proto3's default; an older backup never sets it).
        not_promotable: Some(s.not_promotable).filter(|why| !why.is_empty()),
    })
}

/// What a Promote's error status says. ALREADY_EXISTS (being promoted, or a primary already),
/// UNAVAILABLE, a deadline: the promotion may be under way.
fn promote_error(s: tonic::Status) -> PromoteError {
    match s.code() {
        tonic::Code::FailedPrecondition
        | tonic::Code::InvalidArgument
        | tonic::Code::PermissionDenied
        | tonic::Code::Unauthenticated
        | tonic::Code::Unimplemented => PromoteError::Refused(s.message().to_string()),
        code => PromoteError::Unknown(format!("{code:?}: {}", s.message())),
    }
}

/// A ReplicaService client for `addr`, as this process's identity.
async fn replica_client(
    addr: &str,
    timeout: Duration,
) -> anyhow::Result<ReplicaServiceClient<tonic::transport::Channel>> {
    let ch = dinomo_security::Security::of_process()
        .endpoint(addr, dinomo_security::Service::Dpm)?
        .connect_timeout(timeout.min(Duration::from_millis(500)))
        .timeout(timeout)
        .connect()
        .await?;
    Ok(ReplicaServiceClient::new(ch))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_answer_that_says_nothing_changed_is_a_refusal() {
        use tonic::Code;
        for code in [
            Code::FailedPrecondition,
            Code::InvalidArgument,
            Code::PermissionDenied,
        ] {
            assert_eq!(
                promote_error(tonic::Status::new(code, "copy incomplete")),
                PromoteError::Refused("copy incomplete".into())
            );
        }
        // Being promoted (or a primary already), or no answer: it may be under way.
        for code in [
            Code::AlreadyExists,
            Code::Unavailable,
            Code::DeadlineExceeded,
            Code::Internal,
        ] {
            let e = promote_error(tonic::Status::new(code, "x"));
            assert!(matches!(e, PromoteError::Unknown(_)), "{code:?}: {e:?}");
        }
    }

    #[test]
    fn a_status_is_read_with_its_copy_and_whether_it_may_be_promoted() {
        let answer = |not_promotable: &str| ReplicaStatusResponse {
            role: "backup".into(),
            term: 4,
            copy_state: "complete".into(),
            copy_term: 3,
            generation: 2,
            not_promotable: not_promotable.into(),
            ..Default::default()
        };
        let s = member_status(answer("")).unwrap();
        assert_eq!(
            (s.role, s.term, s.copy_complete, s.copy_term, s.generation),
            (Role::Backup, 4, true, 3, 2)
        );
        assert_eq!(s.not_promotable, None);
        let s = member_status(answer("may pin only 1048576 bytes")).unwrap();
        assert_eq!(
            s.not_promotable.as_deref(),
            Some("may pin only 1048576 bytes")
        );
        let unknown = ReplicaStatusResponse {
            role: "witness".into(),
            ..answer("")
        };
        assert!(member_status(unknown).is_err());
    }

    #[tokio::test]
    async fn a_promote_to_an_address_nothing_listens_on_is_not_sent() {
        // Port 1 on loopback: refused at once, so nothing reached a backup.
        let e = GrpcReplicas
            .promote("127.0.0.1:1", vec![], 1)
            .await
            .unwrap_err();
        assert!(matches!(e, PromoteError::NotSent(_)), "{e:?}");
        let seen = GrpcReplicas
            .status("127.0.0.1:1", Duration::from_millis(500))
            .await;
        assert!(seen.is_err(), "{seen:?}");
    }
}
