//! The control socket: `status`, `restart` and `stop` talk to the live orchestrator through
//! `RUN_DIR/control.sock` (owner-only; the server also checks the peer's uid). One JSON request
//! line, one JSON response line.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Largest request or response accepted.
pub const MAX_MESSAGE: u64 = 64 * 1024;
const TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Request {
    Status,
    /// Restart one worker: by id, or the worker of a GPU.
    Restart {
        worker: Option<u32>,
        gpu: Option<u32>,
        #[serde(default)]
        force: bool,
    },
    Stop,
}

/// A request waiting for the orchestrator's answer.
pub struct Pending {
    pub request: Request,
    pub reply: mpsc::Sender<Value>,
}

/// Parses a request line, refusing anything that is not exactly one known request.
pub fn parse_request(line: &[u8]) -> Result<Request, String> {
    serde_json::from_slice(line).map_err(|e| format!("bad request: {e}"))
}

/// Serves the socket on a thread of its own; requests go to `to_loop`.
pub fn serve(listener: UnixListener, to_loop: mpsc::Sender<super::Input>) {
    let uid = nix::unistd::getuid().as_raw();
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let to_loop = to_loop.clone();
                let _ = std::thread::Builder::new()
                    .name("control-conn".into())
                    .spawn(move || handle(stream, uid, &to_loop));
            }
        })
        .expect("start the control thread");
}

fn handle(mut stream: UnixStream, uid: u32, to_loop: &mpsc::Sender<super::Input>) {
    let _ = stream.set_read_timeout(Some(TIMEOUT));
    let _ = stream.set_write_timeout(Some(TIMEOUT));
    let peer = nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials);
    let answer = match peer {
        Ok(cred) if cred.uid() == uid => {
            let mut line = Vec::new();
            let read = BufReader::new((&stream).take(MAX_MESSAGE + 1)).read_until(b'\n', &mut line);
            match read {
                Ok(_) if line.len() as u64 > MAX_MESSAGE => {
                    serde_json::json!({"error": format!("request larger than {MAX_MESSAGE} bytes")})
                }
                Ok(_) => match parse_request(&line) {
                    Err(e) => serde_json::json!({ "error": e }),
                    Ok(request) => {
                        let (reply, answer) = mpsc::channel();
                        if to_loop
                            .send(super::Input::Control(Pending { request, reply }))
                            .is_err()
                        {
                            serde_json::json!({"error": "the run is shutting down"})
                        } else {
                            answer.recv_timeout(TIMEOUT).unwrap_or_else(
                                |_| serde_json::json!({"error": "no answer from the run"}),
                            )
                        }
                    }
                },
                Err(e) => serde_json::json!({ "error": format!("cannot read the request: {e}") }),
            }
        }
        Ok(cred) => serde_json::json!({
            "error": format!("refused: uid {} is not the run's owner", cred.uid())
        }),
        Err(e) => serde_json::json!({ "error": format!("refused: no peer credentials ({e})") }),
    };
    let mut out = serde_json::to_vec(&answer).unwrap_or_default();
    out.push(b'\n');
    let _ = stream.write_all(&out);
}

/// Why a control request could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no live run in {0} (no control socket)")]
    NotRunning(String),
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Io(String),
}

/// Sends one request to the run in `run_dir`. Refuses a socket that is not owner-only or not ours.
pub fn request(run_dir: &Path, request: &Request) -> Result<Value, ClientError> {
    let path = dflash_common::run_dir::control_socket(run_dir);
    let meta = match std::fs::symlink_metadata(&path) {
        Ok(m) => m,
        Err(_) => return Err(ClientError::NotRunning(run_dir.display().to_string())),
    };
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(ClientError::Refused(format!(
            "refusing {}: its permissions are {mode:o}, not owner-only (0600)",
            path.display()
        )));
    }
    if meta.uid() != nix::unistd::getuid().as_raw() {
        return Err(ClientError::Refused(format!(
            "refusing {}: owned by uid {}, not by you",
            path.display(),
            meta.uid()
        )));
    }
    let mut stream =
        at_short_path(run_dir, |p| UnixStream::connect(p)).map_err(|e| match e.kind() {
            std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound => {
                ClientError::NotRunning(run_dir.display().to_string())
            }
            _ => ClientError::Io(format!("{}: {e}", path.display())),
        })?;
    let _ = stream.set_read_timeout(Some(TIMEOUT));
    let mut line = serde_json::to_vec(request).map_err(|e| ClientError::Io(e.to_string()))?;
    line.push(b'\n');
    stream
        .write_all(&line)
        .map_err(|e| ClientError::Io(format!("{}: {e}", path.display())))?;
    let mut answer = Vec::new();
    BufReader::new((&stream).take(MAX_MESSAGE * 16))
        .read_until(b'\n', &mut answer)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => ClientError::Io(format!(
                "the run does not answer on {} (no answer within {} s): its orchestrator may be stopped or overloaded",
                path.display(),
                TIMEOUT.as_secs()
            )),
            _ => ClientError::Io(format!("{}: {e}", path.display())),
        })?;
    let value: Value = serde_json::from_slice(&answer).map_err(|e| {
        ClientError::Io(format!(
            "{} answered something that is not a control answer ({e}): {:?}",
            path.display(),
            crate::format::clip(&String::from_utf8_lossy(&answer), 200)
        ))
    })?;
    if !value.is_object() {
        return Err(ClientError::Io(format!(
            "{} answered something that is not a control answer: {}",
            path.display(),
            crate::format::clip(&value.to_string(), 200)
        )));
    }
    if let Some(error) = value.get("error").and_then(Value::as_str) {
        return Err(ClientError::Refused(error.to_owned()));
    }
    Ok(value)
}

/// Longest socket path bound or connected directly (`sun_path` holds 108 bytes with its NUL).
const SUN_PATH_MAX: usize = 100;

/// Runs `f` with a path of the run directory's control socket short enough for `bind`/`connect`:
/// the path itself, or for a long run directory, the socket through `/proc/self/fd/N` of the
/// directory opened here (the socket still lives in the run directory, where `status` finds it).
fn at_short_path<T>(
    run_dir: &Path,
    f: impl FnOnce(&Path) -> std::io::Result<T>,
) -> std::io::Result<T> {
    let path = dflash_common::run_dir::control_socket(run_dir);
    if path.as_os_str().len() <= SUN_PATH_MAX {
        return f(&path);
    }
    let dir = std::fs::File::open(run_dir)?;
    let short = Path::new("/proc/self/fd")
        .join(std::os::fd::AsRawFd::as_raw_fd(&dir).to_string())
        .join(dflash_common::run_dir::CONTROL_SOCKET);
    let result = f(&short);
    drop(dir);
    result
}

/// Whether the control socket of `run_dir` can be bound (a long path needs `/proc`).
pub fn check_socket_dir(run_dir: &Path) -> Result<(), String> {
    let path = dflash_common::run_dir::control_socket(run_dir);
    if path.as_os_str().len() > SUN_PATH_MAX && !Path::new("/proc/self/fd").is_dir() {
        return Err(format!(
            "--run-dir {}: its control socket path is {} bytes, over the {SUN_PATH_MAX} a socket may have, and /proc is not mounted to reach it by a shorter one; use a shorter --run-dir",
            run_dir.display(),
            path.as_os_str().len()
        ));
    }
    Ok(())
}

/// Binds the control socket, owner-only.
pub fn bind(run_dir: &Path) -> std::io::Result<UnixListener> {
    let path = dflash_common::run_dir::control_socket(run_dir);
    let _ = std::fs::remove_file(&path);
    let listener = at_short_path(run_dir, |p| UnixListener::bind(p))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_requests_and_refuses_others() {
        assert_eq!(
            parse_request(br#"{"cmd":"status"}"#).unwrap(),
            Request::Status
        );
        assert_eq!(
            parse_request(br#"{"cmd":"restart","worker":2}"#).unwrap(),
            Request::Restart {
                worker: Some(2),
                gpu: None,
                force: false
            }
        );
        for bad in [
            &b"{}"[..],
            b"{\"cmd\":\"rm -rf\"}",
            b"[1]",
            b"\xff",
            b"{\"cmd\":\"restart\",\"worker\":-1}",
        ] {
            assert!(parse_request(bad).is_err());
        }
    }
}
