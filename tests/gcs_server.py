"""A Cloud Storage JSON API server on loopback for the tests, and a proxy that fails requests.

``GcsServer`` runs gcp-storage-emulator (PyPI, pure Python; the ``test`` extra) in a child
process on 127.0.0.1 at an ephemeral port over a temporary root, and points every client of the
project at it through the environment, which the processes a test starts inherit:
``STORAGE_EMULATOR_HOST`` for gcsfs (etils epath's gs:// backend, through which the project
writes every file of a run directory but the arrays), ``TENSORSTORE_GCS_HTTP_URL`` with
``GOOGLE_AUTH_TOKEN_FOR_TESTING`` for tensorstore's gcs driver (orbax's arrays). ``objects``
reads what the server holds straight from its JSON API, not through the project's clients.

Where the emulator falls short of what the clients send (worked around here, never by another
client): its HTTP server takes one request at a time with a listen backlog of 5, and tensorstore
opens many connections at once, so the launcher raises the backlog; its downloads lack the
``x-goog-generation`` header that tensorstore reads, and it has no ``moveTo`` (objects.move, what
gcsfs renames with), so the launcher adds both; it ignores the
``ifGenerationMatch`` preconditions of tensorstore's conditional writes (every write succeeds),
so these tests have one writer per object and cannot show a lost race.

``FaultProxy`` forwards to the server and answers chosen requests itself: ``fail(503, n)`` the
next n requests (an outage the clients' retries outlast), ``fail(403, bucket=b)`` every request
naming bucket b (a bucket the credentials may not use).

``T5XV_TEST_BUCKET=NAME`` runs the same run-directory tests against a real bucket instead (the
credentials are the environment's: ``gcloud auth application-default login``); the proxy's fault
tests need the server and are skipped then.
"""
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid

# The emulator's server with what the clients need that it lacks (see the module doc): a listen
# backlog that tensorstore's parallel connections fit in; downloads that carry the object's
# generation in x-goog-generation (tensorstore reads it there: without it a read is "Malformed
# StorageGeneration"); the objects.move call (moveTo), which gcsfs tries first for a rename and
# retries for half a minute when answered 501 before it copies and deletes instead.
_LAUNCH = """
import http.server, sys
from gcp_storage_emulator.handlers import objects
http.server.HTTPServer.request_queue_size = 256
_download = objects.download
def download(request, response, storage, *args, **kwargs):
  _download(request, response, storage, *args, **kwargs)
  if response.status < 300:
    obj = storage.get_file_obj(request.params['bucket_name'], request.params['object_id'])
    response['x-goog-generation'] = obj['generation']
    response['x-goog-metageneration'] = obj['metageneration']
objects.download = download
def move(request, response, storage, *args, **kwargs):
  request.params['dest_bucket_name'] = request.params['bucket_name']
  objects.copy(request, response, storage)
  if response.status < 300:
    storage.delete_file(request.params['bucket_name'], request.params['object_id'])
from gcp_storage_emulator import server
server.HANDLERS = ((r'^/storage/v1/b/(?P<bucket_name>[-.\\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/'
                    r'(?P<dest_object_id>.*[^/]+)$', {'POST': move}),) + server.HANDLERS
server.create_server('127.0.0.1', int(sys.argv[1]), data_dir=sys.argv[2]).run()
"""
INSTALL = "pip install gcp-storage-emulator (or: pip install -e '.[test]')"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _json(url, method='GET', body=None):
  data = None if body is None else json.dumps(body).encode()
  request = urllib.request.Request(url, data=data, method=method,
                                   headers={'Content-Type': 'application/json'})
  with urllib.request.urlopen(request, timeout=30) as response:
    return json.loads(response.read() or b'{}')


class GcsServer:
  """gcp-storage-emulator on 127.0.0.1 (``start``/``stop``), or a real bucket under
  T5XV_TEST_BUCKET (``url`` None)."""

  def __init__(self):
    self.real_bucket = os.environ.get('T5XV_TEST_BUCKET')
    self.url, self.process, self._root = None, None, None

  def start(self):
    if self.real_bucket:
      return self
    self._root = tempfile.TemporaryDirectory(prefix='gcs-server-')
    port = free_port()
    self.url = f'http://127.0.0.1:{port}'
    self.process = subprocess.Popen([sys.executable, '-c', _LAUNCH, str(port), self._root.name],
                                    stdout=subprocess.DEVNULL,
                                    stderr=open(os.path.join(self._root.name, 'server.log'), 'w'))
    deadline = time.time() + 60
    while True:
      try:
        urllib.request.urlopen(self.url + '/', timeout=1).read()
        break
      except OSError:
        if self.process.poll() is not None or time.time() > deadline:
          raise RuntimeError(f'the GCS API server did not start: {self.log()[-2000:]}')
        time.sleep(0.1)
    os.environ.update(client_environment(self.url))
    return self

  def log(self) -> str:
    with open(os.path.join(self._root.name, 'server.log')) as f:
      return f.read()

  def stop(self):
    if self.process:
      self.process.terminate()
      self.process.wait(timeout=30)
      self._root.cleanup()

  def new_bucket(self) -> str:
    """A fresh, empty bucket's ``gs://`` root (on a real bucket: a fresh prefix in it)."""
    if self.real_bucket:
      return f'gs://{self.real_bucket}/t5xv-tests/{uuid.uuid4().hex[:12]}'
    name = f'b-{uuid.uuid4().hex[:12]}'
    _json(f'{self.url}/storage/v1/b?project=test', 'POST', {'name': name})
    return f'gs://{name}'

  def objects(self, uri: str) -> dict:
    """{name relative to ``uri``: size} of every object under ``uri``, as the server lists them."""
    bucket, _, prefix = uri[len('gs://'):].partition('/')
    prefix = prefix.rstrip('/') + '/' if prefix else ''
    if self.real_bucket:
      import gcsfs  # pylint: disable=g-import-not-at-top
      found = gcsfs.GCSFileSystem(use_listings_cache=False).find(uri, detail=True)
      return {k[len(bucket) + 1 + len(prefix):]: int(v['size']) for k, v in found.items()}
    found, token = {}, None
    while True:
      query = {'prefix': prefix, **({'pageToken': token} if token else {})}
      page = _json(f'{self.url}/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(query)}')
      found.update({o['name'][len(prefix):]: int(o['size']) for o in page.get('items', [])})
      token = page.get('nextPageToken')
      if not token:
        return found

  def read(self, uri: str) -> bytes:
    """The bytes of the object ``uri``, straight from the server."""
    bucket, _, name = uri[len('gs://'):].partition('/')
    if self.real_bucket:
      import gcsfs  # pylint: disable=g-import-not-at-top
      return gcsfs.GCSFileSystem(use_listings_cache=False).cat(uri)
    quoted = urllib.parse.quote(name, safe='')
    with urllib.request.urlopen(f'{self.url}/storage/v1/b/{bucket}/o/{quoted}?alt=media',
                                timeout=30) as response:
      return response.read()


def client_environment(url: str) -> dict:
  """The environment that points gcsfs and tensorstore at the API server at ``url``."""
  return {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url,
          'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'test-token'}


class FaultProxy:
  """An HTTP proxy on 127.0.0.1 in front of ``upstream`` that answers chosen requests with an
  error status itself (the JSON error body GCS sends) and forwards the rest. ``failed`` counts
  the requests it answered so."""

  def __init__(self, upstream: str):
    self.upstream = urllib.parse.urlparse(upstream).netloc
    self.lock = threading.Lock()
    self.rule, self.after, self.only, self.method = None, None, None, None
    self.failed, self.forwarded = 0, 0
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = 'HTTP/1.1'  # keep-alive and 100-continue, as the clients expect

      def _any(self):
        body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
        status = proxy._decide(self.command, self.path)
        if status:
          return self._reply(status, {}, json.dumps({'error': {
              'code': status, 'message': f'injected by the test proxy: {status}'}}).encode())
        conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
        try:
          conn.request(self.command, self.path, body=body or None, headers=dict(self.headers))
          response = conn.getresponse()
          self._reply(response.status, response.getheaders(), response.read())
        finally:
          conn.close()

      def _reply(self, status, headers, data):
        self.send_response(status)
        for key, value in headers:
          if key.lower() not in ('connection', 'transfer-encoding', 'content-length', 'server', 'date'):
            self.send_header(key, value)
        self.send_header('Content-Length', str(len(data)))
        if status >= 400:
          self.send_header('Content-Type', 'application/json')
        self.end_headers()
        self.wfile.write(data)

      do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _any

      def log_message(self, *args):
        pass

    class Server(http.server.ThreadingHTTPServer):
      daemon_threads = True

      def handle_error(self, request, client_address):
        pass  # a client that hung up mid-reply (it retries); not the test's business

    self.server = Server(('127.0.0.1', free_port()), Handler)
    self.url = f'http://127.0.0.1:{self.server.server_address[1]}'
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def fail(self, status: int, count=None, bucket=None, after=None, only=None, method=None):
    """Answer ``status`` to the next ``count`` requests (None: every one) that name ``bucket``
    (None: any), whose path contains ``only`` (None: any) and whose HTTP method is ``method``
    (None: any), from the first request whose path contains ``after`` (None: now) on. Paths are
    matched unquoted."""
    with self.lock:
      self.rule, self.after, self.only, self.method = (status, count, bucket), after, only, method

  def heal(self):
    with self.lock:
      self.rule = None

  def _decide(self, method, path):
    path = urllib.parse.unquote(path)
    with self.lock:
      if self.after and self.after in path:
        self.after = None
      if self.rule and not self.after and (self.only is None or self.only in path) and (
          self.method in (None, method)):
        status, count, bucket = self.rule
        if bucket is None or f'/b/{bucket}/' in path + '/' or f'/b/{bucket}?' in path:
          if count is not None:
            self.rule = (status, count - 1, bucket) if count > 1 else None
          self.failed += 1
          return status
      self.forwarded += 1
      return None

  def close(self):
    self.server.shutdown()
    self.server.server_close()
