//! KvService against a real kv-node process: every RPC, its bad inputs, the insert/update
//! statuses, WRONG_OWNER with the map version, pipelining and statistics.

use dinomo_placement::{ClusterMap, KnInfo};
use dinomo_proto::kv::{
    kv_request, BatchRequest, DeleteRequest, GetRequest, KnStatsRequest, KvRequest, PutMode,
    PutRequest,
};
use dinomo_proto::MAP_VERSION_TRAILER;
use tokio_stream::StreamExt;
use tonic::Code;

use super::harness::{eventually, InProcDpm, KnProcess};

fn put(key: &[u8], value: &[u8], mode: PutMode) -> PutRequest {
    PutRequest {
        key: key.to_vec().into(),
        value: value.to_vec().into(),
        mode: mode as i32,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crud_modes_and_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let kn = KnProcess::start(&dpm, 0, &dir.path().join("kn.log"), &["--shards", "2"]);
    let mut c = kn.client().await;

    // Create, read, update, delete.
    c.put(put(b"k1", b"v1", PutMode::Upsert)).await.unwrap();
    assert_eq!(
        c.get(GetRequest {
            key: b"k1"[..].into()
        })
        .await
        .unwrap()
        .into_inner()
        .value,
        &b"v1"[..]
    );
    c.put(put(b"k1", b"v2", PutMode::Update)).await.unwrap();
    assert_eq!(
        c.get(GetRequest {
            key: b"k1"[..].into()
        })
        .await
        .unwrap()
        .into_inner()
        .value,
        &b"v2"[..]
    );
    let e = c.put(put(b"k1", b"v3", PutMode::Insert)).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    let e = c
        .put(put(b"nope", b"v", PutMode::Update))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(
        e.message().contains("update of a missing key"),
        "{}",
        e.message()
    );
    c.put(put(b"k2", b"fresh", PutMode::Insert)).await.unwrap();
    c.delete(DeleteRequest {
        key: b"k1"[..].into(),
    })
    .await
    .unwrap();
    let e = c
        .get(GetRequest {
            key: b"k1"[..].into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .delete(DeleteRequest {
            key: b"k1"[..].into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    // Insert after delete works; an empty value is a value.
    c.put(put(b"k1", b"", PutMode::Insert)).await.unwrap();
    assert_eq!(
        c.get(GetRequest {
            key: b"k1"[..].into()
        })
        .await
        .unwrap()
        .into_inner()
        .value,
        &b""[..]
    );

    // Bad input on every RPC.
    let long_key = vec![b'k'; 1025];
    let huge_value = vec![0u8; (1 << 20) + 1];
    for e in [
        c.get(GetRequest {
            key: Default::default(),
        })
        .await
        .unwrap_err(),
        c.get(GetRequest {
            key: long_key.clone().into(),
        })
        .await
        .unwrap_err(),
        c.put(put(b"", b"v", PutMode::Upsert)).await.unwrap_err(),
        c.put(put(&long_key, b"v", PutMode::Upsert))
            .await
            .unwrap_err(),
        c.put(put(b"k", &huge_value, PutMode::Upsert))
            .await
            .unwrap_err(),
        c.put(PutRequest {
            key: b"k".to_vec().into(),
            value: Default::default(),
            mode: 7,
        })
        .await
        .unwrap_err(),
        c.delete(DeleteRequest {
            key: Default::default(),
        })
        .await
        .unwrap_err(),
        c.batch(BatchRequest { requests: vec![] })
            .await
            .unwrap_err(),
    ] {
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(!e.message().is_empty());
    }
    let r = c
        .batch(BatchRequest {
            requests: vec![KvRequest { id: 9, op: None }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.responses[0].code, Code::InvalidArgument as i32);

    // Batch: statuses per operation, in order; a repeated key runs in order.
    let reqs = vec![
        KvRequest {
            id: 1,
            op: Some(kv_request::Op::Put(put(b"b", b"1", PutMode::Insert))),
        },
        KvRequest {
            id: 2,
            op: Some(kv_request::Op::Put(put(b"b", b"2", PutMode::Insert))),
        },
        KvRequest {
            id: 3,
            op: Some(kv_request::Op::Get(GetRequest {
                key: b"b".to_vec().into(),
            })),
        },
        KvRequest {
            id: 4,
            op: Some(kv_request::Op::Delete(DeleteRequest {
                key: b"missing".to_vec().into(),
            })),
        },
    ];
    let r = c
        .batch(BatchRequest { requests: reqs })
        .await
        .unwrap()
        .into_inner()
        .responses;
    let codes: Vec<i32> = r.iter().map(|x| x.code).collect();
    assert_eq!(
        codes,
        vec![0, Code::AlreadyExists as i32, 0, Code::NotFound as i32]
    );
    assert_eq!(r[2].value, &b"1"[..]);

    // Interleaved keys (as a client coalescing concurrent operations sends them): each key's
    // operations run in the batch's order, whatever the other keys do.
    let op = |id: u64, o: kv_request::Op| KvRequest { id, op: Some(o) };
    let get = |k: &[u8]| {
        kv_request::Op::Get(GetRequest {
            key: k.to_vec().into(),
        })
    };
    let upsert = |k: &[u8], v: &[u8]| kv_request::Op::Put(put(k, v, PutMode::Upsert));
    let reqs = vec![
        op(10, upsert(b"ia", b"1")),
        op(11, upsert(b"ib", b"1")),
        op(12, upsert(b"ia", b"2")),
        op(13, get(b"ia")),
        op(14, get(b"ib")),
        op(15, upsert(b"ib", b"2")),
        op(16, get(b"ib")),
        op(17, get(b"ic")),
        op(
            18,
            kv_request::Op::Delete(DeleteRequest {
                key: b"ia".to_vec().into(),
            }),
        ),
        op(19, get(b"ia")),
    ];
    let r = c
        .batch(BatchRequest { requests: reqs })
        .await
        .unwrap()
        .into_inner()
        .responses;
    let ids: Vec<u64> = r.iter().map(|x| x.id).collect();
    assert_eq!(
        ids,
        (10..20).collect::<Vec<_>>(),
        "answers in request order"
    );
    let got: Vec<(i32, &[u8])> = r.iter().map(|x| (x.code, &x.value[..])).collect();
    let nf = Code::NotFound as i32;
    assert_eq!(
        got,
        vec![
            (0, &b""[..]),
            (0, b""),
            (0, b""),
            (0, b"2"),
            (0, b"1"),
            (0, b""),
            (0, b"2"),
            (nf, b""),
            (0, b""),
            (nf, b""),
        ]
    );

    // Pipelining: many requests in flight on one stream.
    let reqs: Vec<KvRequest> = (0..200u64)
        .map(|i| KvRequest {
            id: i,
            op: Some(kv_request::Op::Put(put(
                format!("p{i}").as_bytes(),
                format!("v{i}").as_bytes(),
                PutMode::Upsert,
            ))),
        })
        .collect();
    let mut out = c
        .pipeline(tokio_stream::iter(reqs))
        .await
        .unwrap()
        .into_inner();
    let mut ids = Vec::new();
    while let Some(r) = out.next().await {
        let r = r.unwrap();
        assert_eq!(r.code, 0, "{}", r.message);
        ids.push(r.id);
    }
    ids.sort_unstable();
    assert_eq!(ids, (0..200).collect::<Vec<_>>());
    for i in (0..200).step_by(37) {
        let v = c
            .get(GetRequest {
                key: format!("p{i}").into_bytes().into(),
            })
            .await
            .unwrap()
            .into_inner()
            .value;
        assert_eq!(v, format!("v{i}").into_bytes());
    }

    let s = c
        .stats(KnStatsRequest { top_keys: 3 })
        .await
        .unwrap()
        .into_inner();
    assert!(s.puts >= 200 && s.gets >= 5, "{s:?}");
    assert!(
        s.batches > 0 && s.batches < s.puts,
        "group commit must batch: {} batches for {} puts",
        s.batches,
        s.puts
    );
    assert!(s.value_hits + s.unmerged_hits > 0);
    assert!(!s.top_keys.is_empty());
    assert!(s.bytes_written > 0);
    dpm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_owner_carries_the_map_version() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let kn = KnProcess::start(&dpm, 0, &dir.path().join("kn.log"), &[]);
    // A map where KN 1 (not running) owns part of the key space.
    let map = ClusterMap::new(
        vec![
            KnInfo {
                id: 0,
                endpoint: kn.addr.to_string(),
            },
            KnInfo {
                id: 1,
                endpoint: "127.0.0.1:1".into(),
            },
        ],
        64,
        1,
    )
    .unwrap();
    dpm.publish_map(&map).await;
    let mut c = kn.client().await;
    let (mine, theirs): (Vec<String>, Vec<String>) = (0..200)
        .map(|i| format!("key{i}"))
        .partition(|k| map.owner(k.as_bytes()) == Some(0));
    assert!(!mine.is_empty() && !theirs.is_empty());
    let probe = theirs[0].clone().into_bytes();
    eventually("the KN to load the published map", async || {
        c.get(GetRequest {
            key: probe.clone().into(),
        })
        .await
        .err()
        .is_some_and(|e| e.code() == Code::FailedPrecondition)
    })
    .await;
    for k in &theirs {
        let e = c
            .put(put(k.as_bytes(), b"v", PutMode::Upsert))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.message().contains("wrong owner"), "{}", e.message());
        let v = e
            .metadata()
            .get(MAP_VERSION_TRAILER)
            .expect("map version trailer");
        assert_eq!(v.to_str().unwrap(), map.version.to_string());
    }
    for k in &mine {
        c.put(put(k.as_bytes(), b"v", PutMode::Upsert))
            .await
            .unwrap();
    }
    dpm.stop().await;
}
