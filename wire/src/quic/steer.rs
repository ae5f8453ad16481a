//! Which endpoint of a brick's `SO_REUSEPORT` group a client's datagrams reach.
//!
//! By default the kernel hashes the addresses, so two connections of one client land on the
//! same endpoint worker half the time on a 2-endpoint brick, and a client's bulk lanes then
//! share one thread. [`steer_by_source_port`] attaches a classic BPF program to the group
//! instead: a datagram from source port `p` goes to endpoint `p % endpoints` (the endpoints
//! numbered in the order they were bound). A client that binds its connections to consecutive
//! ports (the brick client's lanes do) then has them on different endpoints; other clients'
//! ports are as random as before, so they spread as before.

#![allow(unsafe_code)]

use std::io;
use std::net::UdpSocket;
use std::os::fd::AsRawFd;

/// cBPF's offset of the network (IP) header, for loads past the UDP header the program starts
/// at (`SKF_NET_OFF` in `<linux/filter.h>`).
const NETWORK_HEADER: u32 = (-0x10_0000_i32) as u32;
/// Bytes of an IPv6 header (extension headers are not expected on a brick's traffic).
const IPV6_HEADER_BYTES: u32 = 40;

fn op(code: u32, k: u32) -> libc::sock_filter {
    jump(code, k, 0, 0)
}

fn jump(code: u32, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter {
        // Every opcode fits in 16 bits (`<linux/bpf_common.h>`).
        code: code as u16,
        jt,
        jf,
        k,
    }
}

/// The program: A = the UDP source port, read after an IPv4 header of any length or an
/// IPv6 header (a dual-stack socket gets both); return A % `endpoints`.
fn program(endpoints: u32) -> [libc::sock_filter; 9] {
    use libc::{BPF_A, BPF_ABS, BPF_ALU, BPF_B, BPF_H, BPF_IND, BPF_JA, BPF_JEQ, BPF_JMP, BPF_K};
    use libc::{BPF_LD, BPF_LDX, BPF_MOD, BPF_MSH, BPF_RET, BPF_RSH};
    [
        // 0–2: the IP version; IPv6 goes to 6. (A jump counts from the next instruction.)
        op(BPF_LD | BPF_B | BPF_ABS, NETWORK_HEADER),
        op(BPF_ALU | BPF_RSH | BPF_K, 4),
        jump(BPF_JMP | BPF_JEQ | BPF_K, 6, 3, 0),
        // 3–5, IPv4: X = the header's length (4 × IHL), A = the half-word after it.
        op(BPF_LDX | BPF_B | BPF_MSH, NETWORK_HEADER),
        op(BPF_LD | BPF_H | BPF_IND, NETWORK_HEADER),
        op(BPF_JMP | BPF_JA, 1),
        // 6, IPv6: A = the half-word after the fixed header.
        op(BPF_LD | BPF_H | BPF_ABS, NETWORK_HEADER + IPV6_HEADER_BYTES),
        // 7–8: the endpoint.
        op(BPF_ALU | BPF_MOD | BPF_K, endpoints),
        op(BPF_RET | BPF_A, 0),
    ]
}

/// Steers the `SO_REUSEPORT` group `socket` belongs to by source port, over its first
/// `endpoints` sockets. Where the kernel refuses the program, the group keeps hashing.
pub fn steer_by_source_port(socket: &UdpSocket, endpoints: usize) -> io::Result<()> {
    let endpoints = u32::try_from(endpoints)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no endpoints to steer to"))?;
    let mut ops = program(endpoints);
    let fprog = libc::sock_fprog {
        len: u16::try_from(ops.len()).map_err(|_| io::ErrorKind::InvalidInput)?,
        filter: ops.as_mut_ptr(),
    };
    // SAFETY: `fprog` points at `ops`, `len` instructions that live until the call returns;
    // the kernel copies the program and keeps no pointer into it. The option's length is
    // that of the `sock_fprog` passed.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_REUSEPORT_CBPF,
            (&raw const fprog).cast(),
            size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::Duration;

    use super::*;
    use crate::quic::udp_socket;

    /// Which of `group` receives a datagram sent from `from` to the group's port on `from`'s
    /// own address (bounded wait).
    fn receiver(group: &[UdpSocket], from: &UdpSocket) -> usize {
        let mut to = from.local_addr().expect("addr");
        to.set_port(group[0].local_addr().expect("addr").port());
        from.send_to(b"x", to).expect("send");
        for _ in 0..200 {
            for (i, socket) in group.iter().enumerate() {
                let mut buf = [0u8; 8];
                if socket.recv_from(&mut buf).is_ok() {
                    return i;
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("the datagram reached no socket of the group");
    }

    fn steered(listen: &str, sender: &str) {
        let listen: SocketAddr = listen.parse().expect("addr");
        let first = udp_socket(listen, true).expect("bind");
        let port = first.local_addr().expect("addr");
        let second = udp_socket(port, true).expect("bind the same port");
        let group = [first, second];
        for socket in &group {
            socket.set_nonblocking(true).expect("nonblocking");
        }
        steer_by_source_port(&group[0], group.len()).expect("attach");
        // Ten consecutive source ports alternate between the two sockets.
        let base = UdpSocket::bind(sender).expect("bind a sender");
        let mut senders = vec![base];
        while senders.len() < 10 {
            let mut next = senders.last().expect("one").local_addr().expect("addr");
            next.set_port(next.port().wrapping_add(1));
            match UdpSocket::bind(next) {
                Ok(s) => senders.push(s),
                // Taken or past the last port: start again elsewhere.
                Err(_) => senders = vec![UdpSocket::bind(sender).expect("bind a sender")],
            }
        }
        for from in &senders {
            let p = usize::from(from.local_addr().expect("addr").port());
            assert_eq!(receiver(&group, from), p % 2, "source port {p}");
        }
    }

    #[test]
    fn a_group_steered_by_source_port_takes_consecutive_ports_in_turn_v4() {
        steered("127.0.0.1:0", "127.0.0.1:0");
    }

    #[test]
    fn a_group_steered_by_source_port_takes_consecutive_ports_in_turn_v6() {
        steered("[::1]:0", "[::1]:0");
    }

    /// A group bound to `[::]` takes IPv4 too; those datagrams are steered by their port.
    #[test]
    fn a_dual_stack_group_steers_ipv4_by_source_port() {
        steered("[::]:0", "127.0.0.1:0");
    }

    #[test]
    fn zero_endpoints_is_refused() {
        let socket = udp_socket("127.0.0.1:0".parse().expect("addr"), true).expect("bind");
        assert_eq!(
            steer_by_source_port(&socket, 0).expect_err("zero").kind(),
            io::ErrorKind::InvalidInput
        );
    }
}
