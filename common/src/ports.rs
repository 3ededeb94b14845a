//! Loopback ports held for the processes this one starts, so that no port is lost between
//! choosing it and a process binding it.
//!
//! A cluster file names every node's ports up front (peers and clients need them), so the tests
//! and the YCSB comparison cannot let each node bind port 0 itself. "Bind port 0, read the port,
//! close, write it into the file" loses the port to whoever binds or connects in between: a
//! node then fails with "Address already in use" (issue 35). So a port is bound (to port 0: the
//! kernel chooses it) and the bound socket is *held*, never listened on, for as long as the
//! processes that use the port run, including while a node is down between a stop and a
//! restart on the same address:
//!
//! - Linux lets a listener bind a port that other sockets hold when every one of them set
//!   `SO_REUSEADDR` and none of the others listens. The reservation sets it, and so does every
//!   listener these ports are given to: `std::net::TcpListener` and tokio's (rdkv-server's
//!   control, fabric and metrics listeners), sshd and redis-server. A second listener on the
//!   port still fails with "Address already in use".
//! - While the reservation holds a port, the kernel gives it neither to another bind to port 0
//!   nor to an outgoing connection as its local port.
//! - A connection to a held port on which nothing listens is refused: a reservation is also how
//!   a test names an address where nothing listens (a port merely released may be taken).
//!
//! The reservation must be made before the process binds (a socket cannot join a port that
//! already has a listener), and dropped only after the processes using it are stopped.

use std::net::{Ipv4Addr, SocketAddr};

/// Loopback ports bound (to port 0) and held, never listened on; see the module docs. The
/// ports are released when it is dropped.
#[derive(Debug)]
pub struct ReservedPorts {
    /// The bound sockets: holding them is what keeps the ports.
    sockets: Vec<tokio::net::TcpSocket>,
    /// Their addresses, in the order reserved.
    addresses: Vec<SocketAddr>,
}

impl ReservedPorts {
    /// Reserves `count` distinct loopback ports.
    ///
    /// # Errors
    /// The OS refuses to create or bind a socket (file descriptors exhausted, say).
    pub fn loopback(count: usize) -> std::io::Result<Self> {
        let mut sockets = Vec::with_capacity(count);
        let mut addresses = Vec::with_capacity(count);
        for _ in 0..count {
            // Needs no runtime: the socket is registered with one only to listen or connect,
            // which a reservation never does.
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.set_reuseaddr(true)?;
            socket.bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
            addresses.push(socket.local_addr()?);
            sockets.push(socket);
        }
        Ok(Self { sockets, addresses })
    }

    /// The reserved addresses (127.0.0.1 and a port each), in the order reserved.
    pub fn addresses(&self) -> &[SocketAddr] {
        &self.addresses
    }

    /// The reserved ports, in the order reserved.
    pub fn ports(&self) -> Vec<u16> {
        self.addresses.iter().map(SocketAddr::port).collect()
    }

    /// Adds `other`'s ports to these (held until this is dropped).
    pub fn extend(&mut self, other: ReservedPorts) {
        self.sockets.extend(other.sockets);
        self.addresses.extend(other.addresses);
    }
}

#[cfg(test)]
mod tests {
    use super::ReservedPorts;
    use std::io::ErrorKind;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn a_held_port_refuses_connections_and_other_binds_but_not_its_listener() {
        let reserved = ReservedPorts::loopback(1).expect("reserve");
        let address = reserved.addresses()[0];
        assert_eq!(reserved.ports(), vec![address.port()]);

        // Nothing listens: a connection is refused.
        let refused = TcpStream::connect(address).expect_err("nothing listens");
        assert_eq!(refused.kind(), ErrorKind::ConnectionRefused, "{refused}");

        // A socket without SO_REUSEADDR cannot take it.
        let probe = tokio::net::TcpSocket::new_v4().expect("socket");
        let error = probe.bind(address).expect_err("the port is held");
        assert_eq!(error.kind(), ErrorKind::AddrInUse, "{error}");

        // The process it is meant for binds and serves it, and again after a restart; a second
        // listener at once is refused.
        for _restart in 0..2 {
            let listener = TcpListener::bind(address).expect("a listener binds the held port");
            let second = TcpListener::bind(address).expect_err("one listener only");
            assert_eq!(second.kind(), ErrorKind::AddrInUse, "{second}");
            let _client = TcpStream::connect(address).expect("connect");
            listener.accept().expect("accept");
        }
    }

    #[test]
    fn ports_are_distinct() {
        let mut reserved = ReservedPorts::loopback(8).expect("reserve");
        reserved.extend(ReservedPorts::loopback(8).expect("reserve more"));
        let mut ports = reserved.ports();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 16);
    }
}
