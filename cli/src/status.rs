//! `dinomo status`: the cluster as the routing node and the nodes themselves report it.

use dinomo_security::{Security, Service};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use dinomo_client::Client;
use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
use dinomo_proto::dpm::{BackupState, ReplicaStatusRequest, ReplicaStatusResponse, StatsRequest};
use dinomo_proto::kv::kv_service_client::KvServiceClient;
use dinomo_proto::kv::KnStatsRequest;

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub security: dinomo_security::SecurityArgs,
    /// A routing node (host:port).
    #[arg(long, env = "DINOMO_ROUTING", default_value = "127.0.0.1:7900")]
    routing: String,
    /// The dpm-node (host:port). A backup's address prints only that backup: its term, its
    /// primary and whether its copy may be promoted.
    #[arg(long, env = "DINOMO_DPM", default_value = "127.0.0.1:7700")]
    dpm: String,
}

fn ratio(a: u64, b: u64) -> String {
    if b == 0 {
        "-".into()
    } else {
        format!("{:.2}", a as f64 / b as f64)
    }
}

/// The index's bytes per key, as `", N B/key"`; nothing while the index holds fewer keys than
/// it has buckets. Its first bucket array (8 MiB) is allocated up front, so until the keys
/// fill it the figure says nothing about a key's cost (one key "cost" 8388608.0 B).
fn per_key(index_bytes: u64, keys: u64, buckets: u64) -> String {
    if keys == 0 || keys < buckets {
        String::new()
    } else {
        format!(", {:.1} B/key", index_bytes as f64 / keys as f64)
    }
}

pub async fn run(a: StatusArgs) -> anyhow::Result<()> {
    let replicas = replica_status(&a.dpm).await;
    if let Ok(r) = &replicas {
        if r.role == "backup" {
            // A backup serves no DpmService: what it is, and whether it may be promoted
            // (asked without the routing node, which may be gone with the primary).
            println!("{}", backup_node_line(&a.dpm, r));
            return Ok(());
        }
    }
    let client = Client::connect(&[&a.routing])
        .await
        .with_context(|| format!("routing node {}", a.routing))?;
    let map = client.map();
    // Ownership share, measured on sampled keys with the ring code clients use.
    let samples = 20_000u64;
    let mut owned = std::collections::HashMap::new();
    for i in 0..samples {
        if let Some(kn) = map.owner(format!("sample-{i}").as_bytes()) {
            *owned.entry(kn).or_insert(0u64) += 1;
        }
    }
    println!(
        "cluster map version {} ({} KV nodes, {} vnodes each, {} replicated keys)",
        map.version,
        map.kns.len(),
        map.vnodes,
        map.replicated.len()
    );
    println!(
        "{:>4}  {:<21} {:>6} {:>9} {:>9} {:>7} {:>7} {:>7} {:>7} {:>7} {:>6}",
        "kn",
        "endpoint",
        "share",
        "gets",
        "puts",
        "value",
        "short",
        "unmerg",
        "miss",
        "RTs/op",
        "busy"
    );
    for kn in &map.kns {
        let share = format!(
            "{:.1}%",
            100.0 * *owned.get(&kn.id).unwrap_or(&0) as f64 / samples as f64
        );
        let stats = async {
            let ch = Security::of_process()
                .endpoint(&kn.endpoint, Service::Kv)?
                .connect_timeout(Duration::from_secs(1))
                .connect()
                .await?;
            anyhow::Ok(
                KvServiceClient::new(ch)
                    .stats(KnStatsRequest { top_keys: 0 })
                    .await?
                    .into_inner(),
            )
        }
        .await;
        match stats {
            Ok(s) => {
                // No gets: the ratios print "-" rather than 0.
                let reads = s.gets;
                println!(
                    "{:>4}  {:<21} {:>6} {:>9} {:>9} {:>7} {:>7} {:>7} {:>7} {:>7} {:>5.0}%",
                    kn.id,
                    kn.endpoint,
                    share,
                    s.gets,
                    s.puts,
                    ratio(s.value_hits, reads),
                    ratio(s.shortcut_hits, reads),
                    ratio(s.unmerged_hits, reads),
                    ratio(s.misses, reads),
                    ratio(s.round_trips, s.gets + s.puts + s.deletes),
                    s.occupancy * 100.0
                );
            }
            Err(e) => println!(
                "{:>4}  {:<21} {:>6}  unreachable: {e}",
                kn.id, kn.endpoint, share
            ),
        }
    }
    let dpm = async {
        anyhow::Ok(DpmServiceClient::new(
            Security::of_process()
                .endpoint(&a.dpm, Service::Dpm)?
                .connect()
                .await?,
        ))
    };
    match dpm.await {
        Ok(mut d) => {
            let s = d.stats(StatsRequest {}).await?.into_inner();
            println!(
                "dpm-node {}: {} of {} segments free ({} kept in reserve), {} keys indexed ({} buckets, {} splits), {} entries merged, pending segments {:?}, durability {}",
                a.dpm, s.segments_free, s.segments_total, s.segments_reserved, s.index_items, s.index_buckets, s.index_resizes, s.entries_merged, s.pending_segments, s.durability
            );
            let share = |b: u64| b as f64 / s.pool_bytes.max(1) as f64 * 100.0;
            println!(
                "  space: pool {} MiB; live data {:.1} MiB ({:.1}%); index {:.1} MiB ({:.1}%{}); free {:.1} MiB ({:.1}%)",
                s.pool_bytes >> 20,
                s.live_log_bytes as f64 / 1048576.0,
                share(s.live_log_bytes),
                s.index_bytes as f64 / 1048576.0,
                share(s.index_bytes),
                per_key(s.index_bytes, s.index_items, s.index_buckets),
                (s.segments_free * s.segment_size) as f64 / 1048576.0,
                share(s.segments_free * s.segment_size),
            );
        }
        Err(e) => println!("dpm-node {}: unreachable: {e}", a.dpm),
    }
    match replicas {
        Ok(r) if r.backups.is_empty() => println!(
            "  replicas: none (a single dpm-node; `dinomo up --dpm-replicas 3` replicates it)"
        ),
        Ok(r) => {
            println!(
                "  replicas: primary {} (term {}) and {} backups:",
                a.dpm,
                r.term,
                r.backups.len()
            );
            // Each backup's own word on its copy marker (what promoting it would read), all
            // asked at once: an unreachable one costs up to 2.5 s.
            let asks: Vec<_> = r
                .backups
                .iter()
                .map(|b| {
                    let addr = b.address.clone();
                    tokio::spawn(async move { replica_status(&addr).await })
                })
                .collect();
            for (b, ask) in r.backups.iter().zip(asks) {
                let own = ask.await.unwrap_or_else(|e| Err(e.into()));
                println!("{}{}", backup_line(b), copy_note(&own));
            }
        }
        // An older dpm-node without the ReplicaService, or one that is starting.
        Err(e) => println!("  replicas: unknown ({e})"),
    }
    Ok(())
}

/// The dpm-node's ReplicaStatus (its role, term and backups), as the process's identity asks
/// (`dinomo status`, `up --dpm-replicas`, `admin fail-dpm`).
pub(crate) async fn replica_status(dpm: &str) -> anyhow::Result<ReplicaStatusResponse> {
    let ch = Security::of_process()
        .endpoint(dpm, Service::Dpm)?
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(2))
        .connect()
        .await?;
    Ok(ReplicaServiceClient::new(ch)
        .status(ReplicaStatusRequest {})
        .await?
        .into_inner())
}

/// A dpm-node that answered as a backup (`dinomo status --dpm <backup>`).
fn backup_node_line(addr: &str, r: &ReplicaStatusResponse) -> String {
    let primary = if r.primary.is_empty() {
        "no primary has attached it since it started".to_string()
    } else {
        format!("primary {}", r.primary)
    };
    format!(
        "dpm-node {addr}: a backup (term {}, {primary}){}",
        r.term,
        copy_note(&Ok(r.clone()))
    )
}

/// What a backup says of its copy marker (`<pool>.copy`), as `; copy ...` for its line.
fn copy_note(own: &anyhow::Result<ReplicaStatusResponse>) -> String {
    match own {
        Ok(r) => match r.copy_state.as_str() {
            "complete" if !r.not_promotable.is_empty() => format!(
                "; copy complete (made under term {}, replica-set generation {}) but NOT \
                 promotable: {}",
                r.copy_term, r.generation, r.not_promotable
            ),
            "complete" => format!(
                "; copy complete (made under term {}, replica-set generation {}): promotable",
                r.copy_term, r.generation
            ),
            "incomplete" => format!(
                "; copy INCOMPLETE (started under term {}): not promotable",
                r.copy_term
            ),
            "none" => "; no copy marker (not attached since its pool was made or opened as a \
                       primary's)"
                .into(),
            // An older dpm-node that does not say.
            "" => String::new(),
            other => {
                format!("; copy marker {other}: not promotable without --accept-incomplete-copy")
            }
        },
        Err(e) => format!("; copy marker unknown: {e}"),
    }
}

/// One backup as `dinomo status` prints it: its state and how far behind the primary it is.
pub(crate) fn backup_line(b: &BackupState) -> String {
    let mut line = format!("    backup {:<21} {:<8}", b.address, b.state);
    match b.state.as_str() {
        "in-sync" => line.push_str(&format!(
            " behind {} records ({} B); copied in {} ms ({:.1} MiB, {:.1} MiB it held already); \
             {:.1} MiB sent",
            b.behind_records,
            b.behind_bytes,
            b.resync_ms,
            b.resync_bytes as f64 / 1048576.0,
            b.resync_skipped_bytes as f64 / 1048576.0,
            b.bytes_sent as f64 / 1048576.0
        )),
        "catching-up" if !b.detail.is_empty() => line.push_str(&format!(
            " copied; acknowledgements wait for it; {}",
            b.detail
        )),
        "catching-up" => line.push_str(&format!(
            " copied; acknowledgements wait for it; {} records ({} B) to go before it may be \
             promoted",
            b.behind_records, b.behind_bytes
        )),
        "syncing" => line.push_str(&format!(
            " copying the pool: {:.1} MiB so far; not counted for acknowledgements yet",
            b.bytes_sent as f64 / 1048576.0
        )),
        "attaching" => line.push_str(&format!(
            " named, not reached yet (retried every second; not counted for \
             acknowledgements): {}",
            b.detail
        )),
        _ => line.push_str(&format!(" {}", b.detail)),
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_per_key_figure_for_a_few_keys() {
        let first_array = 8 << 20;
        assert_eq!(per_key(first_array, 0, 16384), "");
        assert_eq!(per_key(first_array, 1, 16384), "");
        assert_eq!(per_key(first_array, 16383, 16384), "");
        assert_eq!(per_key(first_array, 16384, 16384), ", 512.0 B/key");
    }

    #[test]
    fn a_backup_line_says_how_far_behind_it_is() {
        let b = BackupState {
            address: "127.0.0.1:7720".into(),
            state: "in-sync".into(),
            behind_records: 3,
            behind_bytes: 192,
            resync_ms: 40,
            resync_bytes: 2 << 20,
            resync_skipped_bytes: 5 << 20,
            bytes_sent: 3 << 20,
            ..Default::default()
        };
        let line = backup_line(&b);
        assert!(
            line.contains("in-sync")
                && line.contains("behind 3 records (192 B)")
                && line.contains("(2.0 MiB, 5.0 MiB it held already)"),
            "{line}"
        );
        let f = BackupState {
            state: "failed".into(),
            detail: "no completion within 5000 ms".into(),
            ..b
        };
        assert!(
            backup_line(&f).contains("no completion"),
            "{}",
            backup_line(&f)
        );
        let own = |state: &str| {
            Ok(ReplicaStatusResponse {
                role: "backup".into(),
                term: 3,
                copy_state: state.into(),
                copy_term: 2,
                generation: 1,
                ..Default::default()
            })
        };
        assert!(copy_note(&own("complete"))
            .contains("complete (made under term 2, replica-set generation 1): promotable"));
        assert!(copy_note(&own("incomplete")).contains("not promotable"));
        let pinned = ReplicaStatusResponse {
            not_promotable: "may pin only 1048576 bytes".into(),
            ..own("complete").unwrap()
        };
        assert!(copy_note(&Ok(pinned))
            .contains("generation 1) but NOT promotable: may pin only 1048576 bytes"));
        assert!(copy_note(&own("none")).contains("no copy marker"));
        assert_eq!(copy_note(&own("")), "");
        assert!(copy_note(&Err(anyhow::anyhow!("refused"))).contains("unknown: refused"));
        let line = backup_node_line("b:1", &own("incomplete").unwrap());
        assert!(
            line.starts_with(
                "dpm-node b:1: a backup (term 3, no primary has attached it since it started)"
            ) && line.contains("not promotable"),
            "{line}"
        );
        let waiting = BackupState {
            state: "catching-up".into(),
            detail: "caught up; waiting for the backup to record its copy complete".into(),
            ..Default::default()
        };
        assert!(
            backup_line(&waiting).contains("waiting for the backup to record"),
            "{}",
            backup_line(&waiting)
        );
    }
}
