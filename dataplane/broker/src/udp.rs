//! UDP sockets for the QUIC endpoints, created here (not by s2n-quic) so that SO_REUSEPORT and
//! the buffer sizes are set before bind and the effective sizes can be read back and logged.
//! Called on the main thread at start-up; the sockets then move to their core threads.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;

use socket2::{Domain, Protocol, Socket, Type};

/// A bound, non-blocking UDP socket with the buffer sizes the kernel actually granted.
#[derive(Debug)]
pub(crate) struct BoundSocket {
    pub socket: std::net::UdpSocket,
    pub local_addr: SocketAddr,
    /// Effective SO_RCVBUF / SO_SNDBUF as the kernel reports them (Linux reports twice the
    /// usable size, for its bookkeeping).
    pub recv_buffer_bytes: usize,
    pub send_buffer_bytes: usize,
}

fn force(socket: &Socket, option: libc::c_int, bytes: usize) -> std::io::Result<()> {
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: passes a pointer to a live c_int and its exact size, on a socket we own.
    let result = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            std::ptr::from_ref(&value).cast::<libc::c_void>(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if result != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Creates a UDP socket for `addr` with the requested buffer sizes (SO_RCVBUFFORCE /
/// SO_SNDBUFFORCE when the sysctl maximum is lower and we may use them), SO_REUSEPORT when
/// `reuse_port`, then binds it.
pub(crate) fn bind(
    addr: SocketAddr,
    reuse_port: bool,
    recv_bytes: usize,
    send_bytes: usize,
) -> std::io::Result<BoundSocket> {
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.set_recv_buffer_size(recv_bytes)?;
    // Linux doubles the value it stores; less than asked means the sysctl max capped it.
    if socket.recv_buffer_size()? < recv_bytes
        && let Err(error) = force(&socket, libc::SO_RCVBUFFORCE, recv_bytes)
    {
        tracing::warn!(%error, recv_bytes, "SO_RCVBUFFORCE refused (not root?): net.core.rmem_max caps FELIX_UDP_RECV_BUFFER");
    }
    socket.set_send_buffer_size(send_bytes)?;
    if socket.send_buffer_size()? < send_bytes
        && let Err(error) = force(&socket, libc::SO_SNDBUFFORCE, send_bytes)
    {
        tracing::warn!(%error, send_bytes, "SO_SNDBUFFORCE refused (not root?): net.core.wmem_max caps FELIX_UDP_SEND_BUFFER");
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    let local_addr = socket
        .local_addr()?
        .as_socket()
        .ok_or_else(|| std::io::Error::other("bound to a non-IP address"))?;
    let recv_buffer_bytes = socket.recv_buffer_size()?;
    let send_buffer_bytes = socket.send_buffer_size()?;
    Ok(BoundSocket {
        socket: socket.into(),
        local_addr,
        recv_buffer_bytes,
        send_buffer_bytes,
    })
}
