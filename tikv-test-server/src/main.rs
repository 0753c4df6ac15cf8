//! Runs Tito's TiKV + PD test server until interrupted.
//!
//! ```text
//! tito-tikv-test-server [--split KEY]... [--latency-ms MS]
//! ```
//!
//! Prints the PD endpoint on the first line of standard output (`TITO_PD_ENDPOINTS=...`), so a
//! script can start it in the background and read the line. Everything is kept in memory.

use tito_tikv_test_server::TestCluster;

#[tokio::main]
async fn main() {
    let mut splits = Vec::new();
    let mut latency = std::time::Duration::ZERO;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--split" => match args.next() {
                Some(key) => splits.push(key),
                None => fail("--split needs a key"),
            },
            "--latency-ms" => match args.next().map(|ms| ms.parse::<f64>()) {
                Some(Ok(ms)) if ms.is_finite() && (0.0..=10_000.0).contains(&ms) => {
                    latency = std::time::Duration::from_secs_f64(ms / 1000.0);
                }
                _ => fail("--latency-ms needs a number of milliseconds from 0 to 10000 (0.5, 2)"),
            },
            "-h" | "--help" => {
                println!("usage: tito-tikv-test-server [--split KEY]... [--latency-ms MS]");
                println!("A protocol-level TiKV + PD test double kept in memory; not a database.");
                return;
            }
            other => fail(&format!("unknown argument {other:?}; see --help")),
        }
    }
    let cluster = match TestCluster::start().await {
        Ok(cluster) => cluster,
        Err(err) => fail(&format!("cannot start: {err}")),
    };
    for key in &splits {
        cluster.split(key.as_bytes());
    }
    cluster.set_latency(latency);
    println!("TITO_PD_ENDPOINTS={}", cluster.pd_endpoints().join(","));
    eprintln!(
        "PD on {}, TiKV on {}, {} region(s); in memory only, stop with Ctrl-C",
        cluster.pd_address(),
        cluster.tikv_address(),
        cluster.regions().len()
    );
    std::future::pending::<()>().await;
}

fn fail(message: &str) -> ! {
    eprintln!("tito-tikv-test-server: {message}");
    std::process::exit(2);
}
