"""Deterministic browser checks of the Streamlit app: server process, Chromium, waits, screenshots.

Plain functions and one class, used by the fixtures in tests/browser/conftest.py and by browser
tests directly. The recipe (flags, waits, hiding; summed up in docs/DESIGN.md, "Tests") gave
pixel-identical shots across server and browser restarts on these machines.

Timeouts below are hang guards (generous for 2 busy cores), never speed assertions. They scale
with the env var KVSCOPE_BROWSER_TIMEOUT_S (default 300 s per wait).
"""

from __future__ import annotations

import atexit
import io
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from PIL import Image
from pixelmatch.contrib.PIL import pixelmatch

from engine.serve.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
APP_SCRIPT = REPO_ROOT / "app.py"
SCREENSHOT_DIR = REPO_ROOT / "tests" / "screenshots"
OUT_DIR = SCREENSHOT_DIR / "_out"

WAIT_S = float(os.environ.get("KVSCOPE_BROWSER_TIMEOUT_S", "300"))
VIEWPORT = {"width": 1280, "height": 900}

# Environment every test server gets: the app builds a small seeded engine on the tiny model and
# uses static Plotly configs when KVSCOPE_TEST_MODE=1; nothing may reach the network.
TEST_APP_ENV = {
    "KVSCOPE_TEST_MODE": "1",
    "KVSCOPE_MODEL": "tiny",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

STREAMLIT_FLAGS = [
    "--client.toolbarMode",
    "minimal",
    "--runner.postScriptGC",
    "false",
    "--global.minCachedMessageSize",  # .streamlit/config.toml says why
    "1e18",
    "--theme.base",
    "light",
    "--server.fileWatcherType",
    "none",
    "--server.headless",
    "true",
    "--browser.gatherUsageStats",
    "false",
]

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--hide-scrollbars",
    "--force-color-profile=srgb",
    # partial raster re-drew only part of a repainted button, leaving its rounded corners
    # 1 colour unit off in about half the shots; full-tile raster made them identical
    "--disable-partial-raster",
]

# Injected before any page script: without it a clicked button's corners differed by one colour
# unit in 4 of 60 shots (a transition caught mid-way).
NO_MOTION_INIT_SCRIPT = """
(() => {
  const css = '*, *::before, *::after { transition: none !important; animation: none !important;'
            + ' scroll-behavior: auto !important; }';
  const add = () => {
    const s = document.createElement('style');
    s.setAttribute('data-kvscope-test', 'no-motion');
    s.textContent = css;
    (document.head || document.documentElement).appendChild(s);
  };
  if (document.documentElement) add(); else document.addEventListener('DOMContentLoaded', add);
})();
"""

# Applied only while the screenshot is taken.
# textarea { resize: none }: the resize grip is the browser's own drawing, and Chromium builds draw
# it differently (Debian's 150.0.7871.100 moved its lines by a pixel: 72 pixels per shot with a
# text area); the box, the text and the layout stay
HIDE_CHROME_CSS = """
[data-testid="stHeader"], [data-testid="stToolbar"], [data-testid="stStatusWidget"],
[data-testid="stDecoration"], .js-plotly-plot .hoverlayer { visibility: hidden !important; }
textarea { resize: none !important; }
"""

_DRAWN_JS = """
() => {
  const app = document.querySelector('[data-testid="stApp"]');
  if (!app) return false;
  if (window.__kvscopeWs && window.__kvscopeWs.finals < 1) return false;  // no run finished yet
  if (app.getAttribute('data-test-connection-state') !== 'CONNECTED') return false;
  if (app.getAttribute('data-test-script-state') !== 'notRunning') return false;
  if (document.querySelector('[data-stale="true"], [data-testid="stSkeleton"],'
                             + ' [data-testid="stStatusWidget"]')) return false;
  for (const p of document.querySelectorAll('.js-plotly-plot')) {
    if (!p._fullLayout || !p.querySelector('.main-svg')) return false;
  }
  return true;
}
"""

_TWO_FRAMES_JS = """
async () => {
  await new Promise(r => setTimeout(r, 0));
  await document.fonts.ready;
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
}
"""

# Counts Streamlit's `script_finished` messages as the page receives them. Needed because the
# script-state attribute is not a reliable "a run happened" signal: when all of a fast rerun's
# messages arrive within a few ms, React batches running -> notRunning into one commit and the
# attribute never changes (seen in 1 of 40 clicks). ForwardMsg field 6 is `script_finished`
# (a varint ScriptFinishedStatus; 2 = FINISHED_EARLY_FOR_RERUN, followed by another run).
# Our listener is added in the constructor, so it runs before Streamlit's own.
WEBSOCKET_HOOK_INIT_SCRIPT = """
(() => {
  const NativeWS = window.WebSocket;
  if (!NativeWS || NativeWS.__kvscope) return;
  const state = window.__kvscopeWs = {received: 0, finished: 0, finals: 0, lastStatus: null};
  const scriptFinishedStatus = buf => {
    const b = new Uint8Array(buf);
    let i = 0;
    const varint = () => {
      let v = 0, mul = 1, x;
      do { if (i >= b.length) throw new Error('truncated'); x = b[i++]; v += (x & 0x7f) * mul; mul *= 128; }
      while (x & 0x80);
      return v;
    };
    try {
      while (i < b.length) {
        const tag = varint(), field = Math.floor(tag / 8), wire = tag % 8;
        if (wire === 0) { const v = varint(); if (field === 6) return v; }
        else if (wire === 2) { const n = varint(); i += n; }  // not `i += varint()`: reads i first
        else if (wire === 1) i += 8;
        else if (wire === 5) i += 4;
        else return null;
      }
    } catch (e) { return null; }
    return null;
  };
  class KvscopeWebSocket extends NativeWS {
    constructor(...args) {
      super(...args);
      this.addEventListener('message', ev => {
        state.received += 1;
        if (!(ev.data instanceof ArrayBuffer)) return;
        const status = scriptFinishedStatus(ev.data);
        if (status === null) return;
        state.finished += 1;
        state.lastStatus = status;
        if (status !== 2) state.finals += 1;
      });
    }
  }
  KvscopeWebSocket.__kvscope = true;
  window.WebSocket = KvscopeWebSocket;
})();
"""

_FINALS_JS = "() => window.__kvscopeWs ? window.__kvscopeWs.finals : -1"

# After the last message arrived: let Streamlit's async message queue dispatch (a macrotask),
# then React commit (two frames).
_SETTLE_JS = """
async () => {
  await new Promise(r => setTimeout(r, 0));
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
}
"""

_EXCEPTION_TEXT_JS = """
() => {
  const parts = [];
  for (const el of document.querySelectorAll('[data-testid="stException"]'))
    parts.push('stException: ' + el.innerText.slice(0, 2000));
  const body = document.body ? document.body.innerText : '';
  const i = body.indexOf('Traceback');
  if (i >= 0) parts.push('Traceback text: ' + body.slice(Math.max(0, i - 200), i + 1500));
  return parts.join('\\n---\\n');
}
"""


# --------------------------------------------------------------------------------------------
# Streamlit server
# --------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the test process dies, even by SIGKILL or an
    unhandled SIGTERM that skips fixture teardown and atexit (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except Exception:
        pass


_LIVE_SERVERS: set["StreamlitServer"] = set()


@atexit.register
def _stop_leftover_servers() -> None:  # last resort if pytest dies before fixture teardown
    for server in list(_LIVE_SERVERS):
        server.stop()


class StreamlitServer:
    """`streamlit run SCRIPT` on a free localhost port, in its own process group.

    Output goes to a log file (`log_text()`), so a failed start or a server-side traceback can be
    shown in the test failure. Use as a context manager or call start()/stop().
    """

    def __init__(
        self,
        script: str | os.PathLike = APP_SCRIPT,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike = REPO_ROOT,
    ):
        self.script = Path(script).resolve()
        self.env = {**TEST_APP_ENV, **(env or {})}
        self.cwd = Path(cwd)
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None
        self._log = None
        self._last_log = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        """Everything the server printed (kept after stop())."""
        if self._log is None:
            return self._last_log
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def _close_log(self) -> None:
        if self._log is not None:
            self._last_log = self.log_text()
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            self._log = None

    def start(self) -> "StreamlitServer":
        if not self.script.is_file():
            raise FileNotFoundError(f"Streamlit script not found: {self.script}")
        for _attempt in range(3):  # a free port can be taken by someone else before we bind it
            if self._try_start():
                return self
            died_on_port = "address already in use" in self.log_text().lower()
            self.stop()
            if not died_on_port:
                break
        raise RuntimeError(
            f"streamlit server for {self.script} did not become healthy.\n--- server log ---\n{self.log_text()[-6000:]}"
        )

    def _try_start(self) -> bool:
        self.port = free_port()
        self._close_log()
        self._log = tempfile.NamedTemporaryFile("w+", prefix="kvscope-streamlit-", suffix=".log", delete=False)
        cmd = [
            sys.executable,
            "-m",
            "streamlit",
            "run",
            str(self.script),
            *STREAMLIT_FLAGS,
            "--server.port",
            str(self.port),
            "--server.address",
            "127.0.0.1",
        ]
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.cwd,
            env={**os.environ, **self.env},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        _LIVE_SERVERS.add(self)
        deadline = t0 + WAIT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/_stcore/health", timeout=5) as r:
                    if r.status == 200 and r.read().strip() == b"ok":
                        self.start_seconds = time.monotonic() - t0
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)  # a bounded poll of /health that also watches the process (False: retry)
        return False

    def stop(self) -> None:
        _LIVE_SERVERS.discard(self)
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if proc is not None:
            try:  # children of streamlit (if any) live in the same group
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._close_log()

    def __enter__(self) -> "StreamlitServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"StreamlitServer({self.script.name}, url={self.url if self.port else None})"


# --------------------------------------------------------------------------------------------
# Browser
# --------------------------------------------------------------------------------------------


def chromium_path() -> str:
    return os.environ.get("KVSCOPE_CHROMIUM", "/usr/bin/chromium")


def launch_browser(playwright):
    """Debian's Chromium via its /usr/bin wrapper (Playwright cannot download browsers here)."""
    exe = chromium_path()
    if not os.access(exe, os.X_OK):
        raise RuntimeError(
            f"Chromium not found at {exe}. Install it with `apt-get install -y "
            "chromium` (scripts/test.sh does), set KVSCOPE_CHROMIUM, or deselect "
            "browser tests with -m 'not browser'."
        )
    return playwright.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_ARGS)


def new_context(browser):
    """A context with everything that affects pixels pinned."""
    ctx = browser.new_context(
        viewport=dict(VIEWPORT),
        device_scale_factor=1,
        reduced_motion="reduce",
        color_scheme="light",
        locale="en-US",
        timezone_id="UTC",
        service_workers="block",
    )
    ctx.add_init_script(NO_MOTION_INIT_SCRIPT)
    ctx.add_init_script(WEBSOCKET_HOOK_INIT_SCRIPT)
    ctx.set_default_timeout(WAIT_S * 1000)
    ctx.set_default_navigation_timeout(WAIT_S * 1000)
    return ctx


# --------------------------------------------------------------------------------------------
# Waits and actions
# --------------------------------------------------------------------------------------------


def wait_drawn(page, timeout_s: float | None = None) -> None:
    """Wait until the page is fully drawn, not merely "script finished".

    Connection up and script `notRunning`; no stale element, skeleton or status widget; every
    Plotly chart has its layout and SVG; fonts loaded; then two animation frames. Pages with a
    live `st.fragment(run_every=...)` never settle: render them without it in test mode.
    """
    page.wait_for_function(_DRAWN_JS, timeout=(timeout_s or WAIT_S) * 1000, polling=50)
    page.evaluate(_TWO_FRAMES_JS)
    # a rerun may have started during the frames (e.g. a widget's deferred callback): re-check
    page.wait_for_function(_DRAWN_JS, timeout=(timeout_s or WAIT_S) * 1000, polling=50)


def rerun_after(page, action, timeout_s: float | None = None, what: str = "the action"):
    """Run `action()` (anything that makes Streamlit rerun: a click, typing + Enter, choosing an
    option), wait until that rerun has finished and is rendered, then wait_drawn.

    "Finished" means a `script_finished` message (not "finished early for a rerun") arrived
    after the action; the script-state attribute alone misses fast reruns, and for 40-80 ms
    after a click the old state is still shown. Parks the mouse afterwards. Needs a page from
    shot.new_context (the `page` fixture is one). Returns what action() returned."""
    before = page.evaluate(_FINALS_JS)
    if before < 0:
        raise RuntimeError("rerun_after needs a page from shot.new_context (websocket hook)")
    result = action()
    try:
        page.wait_for_function(
            f"() => window.__kvscopeWs.finals > {before}", timeout=(timeout_s or WAIT_S) * 1000, polling=20
        )
    except Exception as e:
        raise AssertionError(f"{what} did not start and finish a Streamlit rerun") from e
    page.evaluate(_SETTLE_JS)
    page.mouse.move(0, 0)
    wait_drawn(page, timeout_s)
    return result


def click_and_wait(page, target, timeout_s: float | None = None) -> None:
    """Click `target` (a selector string or a Locator) and wait for the rerun it triggers
    (see rerun_after)."""
    locator = page.locator(target) if isinstance(target, str) else target
    rerun_after(page, locator.click, timeout_s, what=f"clicking {target!r}")


def choose_option(page, label: str, option: str, timeout_s: float | None = None) -> None:
    """Pick `option` in the st.selectbox whose label contains `label`, waiting for the rerun."""
    box = page.locator('[data-testid="stSelectbox"]', has_text=label).first
    box.locator('[role="combobox"], input').first.click()
    opt = page.locator('[role="option"]', has_text=option).first
    rerun_after(page, opt.click, timeout_s, what=f"choosing {option!r} in {label!r}")


def open_page(page, base_url: str, url_path: str = "", timeout_s: float | None = None):
    """Navigate straight to base_url/url_path (as a user pasting a page URL would) and wait until
    drawn. Fails if Streamlit answers "Page not found" or the page shows an exception.
    Use it on a freshly started server to catch the st.navigation + pages/ pitfall."""
    url = base_url.rstrip("/") + "/" + url_path.lstrip("/")
    page.goto(url, wait_until="domcontentloaded")
    page.mouse.move(0, 0)
    wait_drawn(page, timeout_s)
    dialog = page.locator('[role="dialog"]')
    if dialog.count() and "Page not found" in dialog.first.inner_text():
        raise AssertionError(f"Streamlit answered 'Page not found' for {url}: {dialog.first.inner_text()[:500]}")
    assert_no_exception(page)
    return page


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def main_text(page) -> str:
    """The main area's text as the browser renders it (sidebar excluded)."""
    return page.inner_text('[data-testid="stMain"]')


def exception_text(page) -> str:
    """Text of every st.exception box and of any "Traceback" on the page ('' when none)."""
    return page.evaluate(_EXCEPTION_TEXT_JS)


def page_has_no_exception(page) -> bool:
    return exception_text(page) == ""


def assert_no_exception(page) -> None:
    text = exception_text(page)
    assert not text, f"page {page.url} shows an exception:\n{text}"


_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_\-]*$")


def _updating() -> bool:
    return os.environ.get("KVSCOPE_UPDATE_SCREENSHOTS", "") not in ("", "0", "false", "no")


def take_screenshot(page, extra_css: str = "") -> bytes:
    """PNG of the whole page: the viewport grows to the main area's scroll height (Streamlit
    scrolls inside stMain, so full_page=True would stop at the viewport), header/toolbar/status
    and Plotly's hover layer are hidden, animations disabled, caret hidden. `extra_css` is
    applied for the shot only (e.g. `visibility: hidden` on wall-clock numbers)."""
    page.mouse.move(0, 0)
    wait_drawn(page)
    height = page.evaluate(
        "() => { const m = document.querySelector('[data-testid=\"stMain\"]');"
        " return m ? m.scrollHeight : document.documentElement.scrollHeight; }"
    )
    grown = max(VIEWPORT["height"], int(height))
    try:
        if grown != VIEWPORT["height"]:
            page.set_viewport_size({"width": VIEWPORT["width"], "height": grown})
            wait_drawn(page)
        return page.screenshot(animations="disabled", caret="hide", style=HIDE_CHROME_CSS + extra_css, scale="css")
    finally:
        if grown != VIEWPORT["height"]:
            page.set_viewport_size(dict(VIEWPORT))


def diff_pixels(a: Image.Image, b: Image.Image) -> tuple[int, Image.Image | None]:
    """(number of differing pixels, diff image) of two same-size images; (-1, None) on size
    mismatch. The diff image is `b` (the actual shot) in faded grey, differing pixels in magenta.

    pixelmatch with threshold 0 and anti-aliasing detection off (includeAA=True) is exact: its
    YIQ colour delta is a positive-definite quadratic form of the RGB difference, so any change,
    one unit in one channel included, is above a threshold of 0, and no pixel is excused as
    anti-aliasing. Pure Python: byte-identical images return at once; a mismatch takes seconds
    per megapixel, on the failing path only."""
    a, b = a.convert("RGB"), b.convert("RGB")
    if a.size != b.size:
        return -1, None
    out = Image.new("RGBA", a.size)
    count = pixelmatch(b, a, out, threshold=0, includeAA=True, diff_color=(255, 0, 255))
    return count, out.convert("RGB")


def assert_screenshot(
    page, name: str, *, extra_css: str = "", baseline_dir: str | os.PathLike = SCREENSHOT_DIR
) -> None:
    """Compare a full-page shot with `<baseline_dir>/<name>.png`, pixel-exactly.

    Mismatch: saves `<name>.actual.png` and `<name>.diff.png` under tests/screenshots/_out/ and
    fails with the number of differing pixels. Missing baseline: writes it and fails (look at it,
    commit it, rerun). KVSCOPE_UPDATE_SCREENSHOTS=1: (re)writes baselines and passes.
    `extra_css` is applied for the shot only (hide values that vary run to run; keep space).
    """
    if not _NAME_RE.match(name):
        raise ValueError(f"screenshot name {name!r}: use lowercase letters, digits, '_' and '-'")
    baseline = Path(baseline_dir) / f"{name}.png"
    png = take_screenshot(page, extra_css)
    if _updating() or not baseline.exists():
        existed = baseline.exists()
        baseline.parent.mkdir(parents=True, exist_ok=True)
        baseline.write_bytes(png)
        if not existed and not _updating():
            raise AssertionError(
                f"no baseline for screenshot {name!r}: wrote {baseline}. Look at it, commit it if right, and rerun."
            )
        return
    actual = Image.open(io.BytesIO(png))
    expected = Image.open(baseline)
    count, diff = diff_pixels(expected, actual)
    if count == 0:
        return
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    actual_path = OUT_DIR / f"{name}.actual.png"
    actual_path.write_bytes(png)
    if count < 0:
        raise AssertionError(
            f"screenshot {name!r}: size {actual.size} != baseline {expected.size}; actual saved to {actual_path}"
        )
    diff_path = OUT_DIR / f"{name}.diff.png"
    diff.save(diff_path)
    raise AssertionError(
        f"screenshot {name!r}: {count} pixels differ from {baseline}; actual "
        f"saved to {actual_path}, diff to {diff_path}. If the change is "
        "intended, rerun with KVSCOPE_UPDATE_SCREENSHOTS=1 and commit."
    )
