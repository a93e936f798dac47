//! A runnable tour of the SDK against a local cluster:
//!
//! ```sh
//! cargo run --release -p dinomo-cli --bin dinomo -- up            # in one terminal
//! cargo run -p dinomo-client --example quickstart [ROUTING_ADDR]   # in another
//! ```

use dinomo_client::{Client, ClientError, Op};

#[tokio::main]
async fn main() -> Result<(), ClientError> {
    let routing = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:7900".into());
    let client = Client::connect(&[routing]).await?;
    println!(
        "connected; cluster map version {} with {} KV nodes",
        client.map().version,
        client.map().kns.len()
    );

    client.put("greeting", "hello").await?;
    println!("get greeting -> {:?}", client.get("greeting").await?);

    match client.insert("greeting", "again").await {
        Err(ClientError::AlreadyExists) => {
            println!("insert greeting -> already exists (insert never overwrites)")
        }
        other => other?,
    }
    client.update("greeting", "hello, world").await?;
    println!("after update -> {:?}", client.get("greeting").await?);

    let results = client
        .batch(vec![
            Op::put("a", "1"),
            Op::put("b", "2"),
            Op::get("a"),
            Op::get("missing"),
        ])
        .await?;
    println!("batch -> {results:?}");

    println!(
        "delete greeting -> existed: {}",
        client.delete("greeting").await?
    );
    println!(
        "delete greeting again -> existed: {}",
        client.delete("greeting").await?
    );
    Ok(())
}
