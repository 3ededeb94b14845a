//! Operations in flight per connection for a client made from a cluster file: as many as it was
//! asked for (`ClientBuilder::concurrency`; the YCSB driver asks for its task count),
//! and 16 by default. Before, a client from a file always had 16, so `rdkv-ycsb run --threads
//! 64` ran 16 operations per connection while the other tasks waited for scratch buffers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rdkv_client::fault::{FaultInjector, Injection, Moment, Step};
use rdkv_client::{Backend, ClientBuilder, FabricChoice};
use rdkv_server::ServerConfig;
use tokio::sync::Semaphore;

mod support;

const SECRET: &[u8] = b"concurrency-test-secret";

/// Holds every GET before its first step, counting those that got that far (each holds a
/// scratch buffer by then).
#[derive(Debug)]
struct Gate {
    arrived: AtomicUsize,
    release: Arc<Semaphore>,
}

impl FaultInjector for Gate {
    fn inject(&self, step: &Step) -> Injection {
        if step.operation == "get" && step.number == 0 && step.moment == Moment::Before {
            self.arrived.fetch_add(1, Ordering::SeqCst);
            return Injection::WaitFor(self.release.clone());
        }
        Injection::Proceed
    }
}

/// Runs 40 GETs at once through a client made from a cluster file with `concurrency` (or the
/// default), and returns how many reached their first step while none could finish.
async fn in_flight(concurrency: Option<usize>) -> usize {
    let server = rdkv_server::start(ServerConfig::local(SECRET))
        .await
        .expect("start server");
    let fabric_address = server
        .fabric_address()
        .expect("a soft node has a fabric address");
    let path = std::env::temp_dir().join(format!(
        "rdkv-concurrency-{}-{}.toml",
        std::process::id(),
        concurrency.unwrap_or(0)
    ));
    let text = format!(
        "[cluster]\nname = \"concurrency\"\nsecret = \"{}\"\nfabric = \"soft\"\n\n[[node]]\nid = 1\n\
         control_address = \"{}\"\nfabric_address = \"{fabric_address}\"\nindex_size = \"256K\"\n\
         heap_size = \"4M\"\nchunk_size = \"64K\"\n",
        String::from_utf8_lossy(SECRET),
        server.control_address(),
    );
    std::fs::write(&path, text).expect("write the cluster file");
    let gate = Arc::new(Gate {
        arrived: AtomicUsize::new(0),
        release: Arc::new(Semaphore::new(0)),
    });
    let mut builder = ClientBuilder::cluster_file(&path)
        .fabric(FabricChoice::Cluster(Backend::Soft))
        .fault_injector(gate.clone());
    if let Some(concurrency) = concurrency {
        builder = builder.concurrency(concurrency);
    }
    let client = Arc::new(builder.build().expect("a valid cluster file"));
    std::fs::remove_file(&path).expect("remove the cluster file");
    // Connect first: the gate holds GETs, not the handshake.
    client.connect_all().await.expect("connect");
    let gets: Vec<_> = (0..40)
        .map(|number| {
            let client = client.clone();
            tokio::spawn(async move { client.get(format!("absent-{number}").as_bytes()).await })
        })
        .collect();
    let expected = concurrency.unwrap_or(16).min(40);
    support::eventually_showing(
        "the GETs reach their first step",
        || gate.arrived.load(Ordering::SeqCst),
        |arrived| *arrived >= expected,
    )
    .await;
    // The others wait for a scratch buffer: however long they run, none gets further.
    for _ in 0..200 {
        tokio::task::yield_now().await;
    }
    let arrived = gate.arrived.load(Ordering::SeqCst);
    gate.release.add_permits(40);
    for get in gets {
        assert_eq!(get.await.expect("task").expect("get"), None);
    }
    assert_eq!(gate.arrived.load(Ordering::SeqCst), 40);
    // The others waited, and the counter says so.
    assert_eq!(client.counters().scratch_waits, 40 - expected as u64);
    arrived
}

#[tokio::test(flavor = "current_thread")]
async fn a_client_from_a_file_runs_as_many_operations_at_once_as_it_was_asked_for() {
    assert_eq!(in_flight(Some(24)).await, 24);
}

#[tokio::test(flavor = "current_thread")]
async fn a_client_from_a_file_runs_sixteen_at_once_by_default() {
    assert_eq!(in_flight(None).await, 16);
}
