"""A local stand-in of SandboxFusion's run_code API that really runs the code (python, in a subprocess with stdin
and a time limit): the code rewards' and the code tools' tests share it."""
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Sandbox:
    """run_code as SandboxFusion answers it: {"status": Success|Failed|SandboxError, "compile_result": null,
    "run_result": {"status": Finished|TimeLimitExceeded|Error, "stdout", "stderr", "return_code"}}."""

    def __init__(self, fail_first=0, delay_s=0.0):
        self.requests, self.active, self.peak, self.fail_first, self.delay_s = 0, 0, 0, fail_first, delay_s
        self.lock = threading.Lock()
        box = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with box.lock:
                    box.requests += 1
                    n = box.requests
                    box.active += 1
                    box.peak = max(box.peak, box.active)
                try:
                    if n <= box.fail_first:
                        self.send_response(504)
                        self.end_headers()
                        return
                    time.sleep(box.delay_s)
                    answer = box.run(body)
                finally:
                    with box.lock:
                        box.active -= 1
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/run_code"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def run(body):
        assert body["language"] == "python" and body["memory_limit_MB"] > 0
        try:
            p = subprocess.run([sys.executable, "-c", body["code"]], input=body["stdin"] or "", capture_output=True,
                               text=True, timeout=body["run_timeout"])
        except subprocess.TimeoutExpired:
            return {"status": "Failed", "compile_result": None,
                    "run_result": {"status": "TimeLimitExceeded", "stdout": "", "stderr": "", "return_code": None}}
        run = {"status": "Finished", "stdout": p.stdout, "stderr": p.stderr, "return_code": p.returncode}
        return {"status": "Success" if p.returncode == 0 else "Failed", "compile_result": None, "run_result": run}

    def close(self):
        self.server.shutdown()
        self.server.server_close()
