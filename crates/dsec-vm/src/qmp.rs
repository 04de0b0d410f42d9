//! The QEMU Machine Protocol, as much of it as dsec uses: `stop`, `cont`, `getfd`, and
//! the migration commands that save and restore boot templates.
//!
//! QEMU gets one end of a socketpair as its monitor (`-chardev socket,fd=N`), so there is
//! no socket file to leak or to be reached by anyone else. Commands are serialised by a
//! mutex; asynchronous events QEMU interleaves are skipped.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd};

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::UnixStream;
use tokio::sync::Mutex;

use crate::VmError;

/// A negotiated QMP connection.
pub struct Qmp {
    conn: Mutex<BufReader<UnixStream>>,
}

impl Qmp {
    /// Reads QEMU's greeting and leaves capability negotiation mode.
    pub async fn connect(stream: UnixStream) -> Result<Qmp, VmError> {
        let qmp = Qmp {
            conn: Mutex::new(BufReader::new(stream)),
        };
        {
            let mut conn = qmp.conn.lock().await;
            let greeting = read_message(&mut conn).await?;
            if greeting.get("QMP").is_none() {
                return Err(VmError::Qemu(format!("unexpected QMP greeting {greeting}")));
            }
        }
        qmp.execute("qmp_capabilities", json!({})).await?;
        Ok(qmp)
    }

    /// Runs `command` and returns its `return` value.
    pub async fn execute(&self, command: &str, arguments: Value) -> Result<Value, VmError> {
        let mut conn = self.conn.lock().await;
        let line = command_line(command, arguments);
        conn.get_mut()
            .write_all(&line)
            .await
            .map_err(|e| VmError::Qemu(format!("monitor write: {e}")))?;
        answer(&mut conn, command).await
    }

    /// Hands QEMU a copy of `fd` under `name` (`getfd`), for a URI such as `fd:<name>`.
    pub async fn send_fd(&self, name: &str, fd: BorrowedFd<'_>) -> Result<(), VmError> {
        let mut conn = self.conn.lock().await;
        let line = command_line("getfd", json!({ "fdname": name }));
        let stream = conn.get_ref();
        let fds = [fd.as_raw_fd()];
        // The whole command goes with the descriptor in one message: QEMU takes the
        // descriptor as it reads the command's first bytes.
        let sent = stream
            .async_io(Interest::WRITABLE, || {
                sendmsg::<()>(
                    stream.as_raw_fd(),
                    &[IoSlice::new(&line)],
                    &[ControlMessage::ScmRights(&fds)],
                    MsgFlags::MSG_DONTWAIT,
                    None,
                )
                .map_err(std::io::Error::from)
            })
            .await
            .map_err(|e| VmError::Qemu(format!("monitor write: {e}")))?;
        if sent < line.len() {
            conn.get_mut()
                .write_all(&line[sent..])
                .await
                .map_err(|e| VmError::Qemu(format!("monitor write: {e}")))?;
        }
        answer(&mut conn, "getfd").await.map(drop)
    }
}

/// `command` with `arguments` as one line of QMP.
fn command_line(command: &str, arguments: Value) -> Vec<u8> {
    let mut line = serde_json::to_vec(&json!({"execute": command, "arguments": arguments}))
        .expect("JSON serializes");
    line.push(b'\n');
    line
}

/// Reads up to the answer to `command`, skipping events.
async fn answer(conn: &mut BufReader<UnixStream>, command: &str) -> Result<Value, VmError> {
    loop {
        let msg = read_message(conn).await?;
        if let Some(ret) = msg.get("return") {
            return Ok(ret.clone());
        }
        if let Some(err) = msg.get("error") {
            let desc = err
                .get("desc")
                .and_then(Value::as_str)
                .unwrap_or("unknown error");
            return Err(VmError::Qemu(format!("{command}: {desc}")));
        }
    }
}

async fn read_message(conn: &mut BufReader<UnixStream>) -> Result<Value, VmError> {
    let mut line = String::new();
    let n = conn
        .read_line(&mut line)
        .await
        .map_err(|e| VmError::Qemu(format!("monitor read: {e}")))?;
    if n == 0 {
        return Err(VmError::Qemu("QEMU exited".into()));
    }
    serde_json::from_str(&line).map_err(|e| VmError::Qemu(format!("monitor sent {line:?}: {e}")))
}
