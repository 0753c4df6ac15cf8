//! Hand-routed gRPC over hyper: every method is a path, decoded and encoded with prost through
//! tonic's codec, the same stack (and versions) as `tikv-client`. Connections are tracked so that
//! a test can kill them all at once, the way a crashed server drops its sockets.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use tokio::net::TcpListener;
use tokio::task::AbortHandle;
use tonic::Status;
use tonic::body::BoxBody;
use tonic::codec::{ProstCodec, Streaming};
use tonic::server::{Grpc, StreamingService, UnaryService};

pub(crate) type HttpRequest = http::Request<hyper::Body>;
pub(crate) type HttpResponse = http::Response<BoxBody>;

/// A routing function: path in, response out.
pub(crate) type Router =
    Arc<dyn Fn(HttpRequest) -> BoxFuture<'static, HttpResponse> + Send + Sync + 'static>;

/// A listening server and its live connections.
pub(crate) struct Server {
    pub addr: SocketAddr,
    tasks: Arc<Mutex<Vec<AbortHandle>>>,
}

impl Server {
    /// Binds a loopback port of the system's choosing and serves HTTP/2 gRPC with `router`,
    /// over TLS when `tls` is given.
    pub async fn start(
        router: Router,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> std::io::Result<Server> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let tasks: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let conn_tasks = tasks.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let router = router.clone();
                let service = hyper::service::service_fn(move |request: HttpRequest| {
                    let router = router.clone();
                    async move { Ok::<_, Infallible>(router(request).await) }
                });
                let tls = tls.clone();
                let task = tokio::spawn(async move {
                    let http = hyper::server::conn::Http::new().http2_only(true).clone();
                    match tls {
                        None => {
                            let _ = http.serve_connection(stream, service).await;
                        }
                        // A handshake that fails (a plain-text client, an unknown CA) closes
                        // the connection; the client sees the error.
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(stream).await {
                                let _ = http.serve_connection(stream, service).await;
                            }
                        }
                    }
                });
                let mut tasks = conn_tasks.lock().expect("connection list");
                tasks.retain(|task| !task.is_finished());
                tasks.push(task.abort_handle());
            }
        });
        tasks
            .lock()
            .expect("connection list")
            .push(accept.abort_handle());
        Ok(Server { addr, tasks })
    }

    /// Stops accepting and drops every open connection.
    pub fn kill(&self) {
        for task in self.tasks.lock().expect("connection list").drain(..) {
            task.abort();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

struct Unary<F>(Option<F>);

impl<Req, Resp, F, Fut> UnaryService<Req> for Unary<F>
where
    F: FnOnce(Req) -> Fut,
    Fut: Future<Output = Result<Resp, Status>> + Send + 'static,
{
    type Response = Resp;
    type Future = BoxFuture<'static, Result<tonic::Response<Resp>, Status>>;

    fn call(&mut self, request: tonic::Request<Req>) -> Self::Future {
        let handler = self.0.take().expect("a unary service is called once");
        let response = handler(request.into_inner());
        Box::pin(async move { response.await.map(tonic::Response::new) })
    }
}

/// Serves one unary call with `handler`.
pub(crate) async fn unary<Req, Resp, F, Fut>(request: HttpRequest, handler: F) -> HttpResponse
where
    Req: prost::Message + Default + Send + 'static,
    Resp: prost::Message + Send + 'static,
    F: FnOnce(Req) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Resp, Status>> + Send + 'static,
{
    let mut grpc = Grpc::new(ProstCodec::<Resp, Req>::default());
    grpc.unary(Unary(Some(handler)), request).await
}

struct Bidi<F>(Option<F>);

impl<Req, Resp, F> StreamingService<Req> for Bidi<F>
where
    Resp: Send + 'static,
    F: FnOnce(Streaming<Req>) -> BoxStream<'static, Result<Resp, Status>>,
{
    type Response = Resp;
    type ResponseStream = BoxStream<'static, Result<Resp, Status>>;
    type Future = BoxFuture<'static, Result<tonic::Response<Self::ResponseStream>, Status>>;

    fn call(&mut self, request: tonic::Request<Streaming<Req>>) -> Self::Future {
        let handler = self.0.take().expect("a streaming service is called once");
        let stream = handler(request.into_inner());
        Box::pin(async move { Ok(tonic::Response::new(stream)) })
    }
}

/// Serves one bidirectional stream with `handler`, which maps the request stream to responses.
pub(crate) fn streaming<Req, Resp, F>(
    request: HttpRequest,
    handler: F,
) -> BoxFuture<'static, HttpResponse>
where
    Req: prost::Message + Default + Send + 'static,
    Resp: prost::Message + Send + 'static,
    F: FnOnce(Streaming<Req>) -> BoxStream<'static, Result<Resp, Status>> + Send + 'static,
{
    Box::pin(async move {
        let mut grpc = Grpc::new(ProstCodec::<Resp, Req>::default());
        grpc.streaming(Bidi(Some(handler)), request).await
    })
}

/// The answer to a method the server does not implement: gRPC status 12 (unimplemented), with
/// the method's path, at once.
pub(crate) fn unimplemented(path: &str) -> HttpResponse {
    Status::unimplemented(format!(
        "{path} is not implemented by Tito's TiKV test server"
    ))
    .to_http()
}

/// A TLS acceptor for a server certificate chain and key (PEM), speaking HTTP/2; with
/// `client_ca` (PEM), clients must present a certificate it signed.
pub(crate) fn tls_acceptor(
    cert_pem: &[u8],
    key_pem: &[u8],
    client_ca: Option<&[u8]>,
) -> std::io::Result<tokio_rustls::TlsAcceptor> {
    use tokio_rustls::rustls;
    let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
    let certs: Vec<rustls::Certificate> = rustls_pemfile::certs(&mut &cert_pem[..])?
        .into_iter()
        .map(rustls::Certificate)
        .collect();
    let key = rustls_pemfile::read_all(&mut &key_pem[..])?
        .into_iter()
        .find_map(|item| match item {
            rustls_pemfile::Item::PKCS8Key(key)
            | rustls_pemfile::Item::RSAKey(key)
            | rustls_pemfile::Item::ECKey(key) => Some(rustls::PrivateKey(key)),
            _ => None,
        })
        .ok_or_else(|| invalid("no private key in the PEM".into()))?;
    let builder = rustls::ServerConfig::builder().with_safe_defaults();
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in rustls_pemfile::certs(&mut &ca[..])? {
                roots
                    .add(&rustls::Certificate(cert))
                    .map_err(|e| invalid(format!("client CA: {e}")))?;
            }
            builder.with_client_cert_verifier(Arc::new(
                rustls::server::AllowAnyAuthenticatedClient::new(roots),
            ))
        }
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| invalid(format!("server certificate: {e}")))?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
