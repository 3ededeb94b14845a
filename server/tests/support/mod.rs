//! What the server's integration tests share: a control connection's authentication, spoken
//! by hand (the client library would hide what these tests look at).

use rdkv_common::protocol::{
    compute_proof, read_frame, write_frame, ClientMessage, Purpose, ServerMessage, PROTOCOL_VERSION,
};
use tokio::net::TcpStream;

/// Reads the node's challenge on `stream`, answers it as a data client named `client_name`
/// with a proof made from `secret` (over the node's shm fabric when `shared_memory`), and
/// returns the node's reply: its welcome, or its refusal.
pub async fn authenticate(
    stream: &mut TcpStream,
    secret: &[u8],
    shared_memory: bool,
    client_name: &str,
) -> ServerMessage {
    let ServerMessage::Challenge { nonce, node_id, .. } =
        read_frame(stream).await.expect("challenge")
    else {
        panic!("no challenge");
    };
    write_frame(
        stream,
        &ClientMessage::Authenticate {
            protocol_version: PROTOCOL_VERSION,
            purpose: Purpose::Data,
            proof: compute_proof(secret, node_id, &nonce),
            client_name: client_name.into(),
            shared_memory,
            routes_by_view: false,
        },
    )
    .await
    .expect("authenticate");
    read_frame(stream).await.expect("the reply to authenticate")
}
