"""Drive JupyterLab in a real browser, as a learner does: start a server, open a notebook, Run All, look.

Used by the browser tests in this folder (``make test-browser``). Two parts:

- :class:`LabServer` starts ``jupyter lab`` on 127.0.0.1 with a random free port and token, in a
  temporary copy of ``notebooks/``, with its own settings (every cell kept in the page, no news
  pop-ups), and stops the whole process group afterwards, whatever happened.
- :class:`NotebookPage` wraps a Playwright page showing one notebook, opened from JupyterLab's file
  browser: run every cell through the Run menu, wait until the kernel is idle, read each cell's outputs
  and images, close its tab (JupyterLab stays loaded for the next notebook).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nbformat
import psutil
from playwright.sync_api import Browser, Locator, Page
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
from status import forget, prediction_cells, record, widget_cells

from dtlib.launch.processes import free_port

# JupyterLab user settings, written into a private settings folder so the learner's own are untouched.
LAB_SETTINGS = {
    # "full" windowing (the default for long notebooks) removes cells scrolled out of view from the
    # page; the tests look at every cell, so keep them all in the DOM.
    # A notebook opens with its own kernel at once instead of asking in a "Select Kernel" dialog.
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none",
                                                                    "autoStartDefaultKernel": True},
    # No "Would you like to receive Jupyter news?" toast over the notebook; the tests need no network.
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
}


class LabServer:
    """``jupyter lab`` serving a copy of ``notebooks`` from a temporary folder.

    Example::

        with LabServer(Path("notebooks"), tmp_path) as lab:
            view = NotebookPage(browser.new_page(), lab, "00_setup_check.ipynb")
    """

    def __init__(self, notebooks: Path, workdir: Path, start_timeout_s: float = 60.0) -> None:
        self.root = workdir / "notebooks"
        self.log_path = workdir / "jupyterlab.log"
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_hex(16)
        self._notebooks = notebooks
        self._workdir = workdir
        self._start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._workspaces = itertools.count(1)

    def url(self) -> str:
        """The address of JupyterLab with no notebook open, token included. Each call gets a workspace of its
        own, reset, so that a page neither reopens the notebooks of earlier pages (and starts their kernels again)
        nor shares its layout with a page still open."""
        return f"{self.address}/lab/workspaces/page{next(self._workspaces)}?reset&token={self.token}"

    def _api(self, path: str, body: object = None, method: str = "GET", timeout_s: float = 10) -> object:
        """The answer of the server's REST API to ``method`` on ``path`` (after /api/), None when it has no body."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.address}/api/{path}", data=data, method=method,
                                         headers={"Authorization": f"token {self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read()
        return json.loads(text) if text else None

    def start_kernel(self, notebook: str, kernel: str) -> None:
        """Start ``notebook``'s session, and with it a ``kernel`` kernel, as JupyterLab does when the notebook opens:
        JupyterLab then joins this session instead of starting its own. The server answers at once, while the
        kernel still starts (it starts while the page opens the notebook, rather than after)."""
        self._api("sessions", {"path": notebook, "name": notebook, "type": "notebook", "kernel": {"name": kernel}},
                  method="POST", timeout_s=30)

    def __enter__(self) -> LabServer:
        shutil.copytree(self._notebooks, self.root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        settings = self._workdir / "lab-settings"
        for name, values in LAB_SETTINGS.items():
            path = settings / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings),
                   JUPYTERLAB_WORKSPACES_DIR=str(self._workdir / "lab-workspaces"),
                   JUPYTER_RUNTIME_DIR=str(self._workdir / "runtime"))
        command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
                   f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                   f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
                   "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                   "--LabApp.extension_manager=readonly"]  # no PyPI queries from a closed network
        if os.geteuid() == 0:
            command.append("--allow-root")  # containers and CI machines often run as root
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(command, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        status = f"{self.address}/api/status?token={self.token}"
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self._process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(status, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"jupyter lab did not answer within {self._start_timeout_s:.0f} s:\n{self.log()}")

    def log(self) -> str:
        """The server's output so far (the last 4000 characters)."""
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def shutdown_kernels(self, notebook: str) -> None:
        """End the sessions (and so the kernels) of ``notebook`` through the REST API."""
        sessions = self._api("sessions")
        assert isinstance(sessions, list)
        for session in sessions:
            if session.get("path") == notebook:
                self._api(f"sessions/{session['id']}", method="DELETE", timeout_s=30)

    def stop(self) -> None:
        """Stop the server and every process under it: kernels (which jupyter starts in sessions of their
        own, out of the server's process group) and the ranks they launched. SIGTERM lets the server shut
        its kernels down; whatever is left after 10 s gets SIGKILL."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        try:
            descendants = psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        _, alive = psutil.wait_procs(descendants, timeout=5)
        for leftover in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                leftover.kill()


#: Loaded images (naturalWidth > 0) per cell of a notebook panel, one count per cell in the page's order (markdown
#: cells 0), widgets' own images left out: one call for the whole notebook instead of two per cell.
_COUNT_IMAGES = """panel => [...panel.querySelectorAll('.jp-Notebook .jp-Cell')].map(cell =>
    !cell.classList.contains('jp-CodeCell') ? 0 : [...cell.querySelectorAll('.jp-OutputArea-output img')]
        .filter(img => !img.closest('.jupyter-widgets') && img.complete && img.naturalWidth > 0).length)"""


#: The id of the notebook panel of ``name`` (a file name) once its tab is the main area's current one; else false.
_SHOWN = """name => {
    const tab = [...document.querySelectorAll('.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current')]
        .find(tab => tab.querySelector('.lm-TabBar-tabLabel')?.textContent.trim() === name);
    const panel = tab && document.getElementById(tab.dataset.id);
    return !!panel && panel.classList.contains('jp-NotebookPanel') && !panel.classList.contains('lm-mod-hidden')
        && !!panel.querySelector('.jp-Notebook .jp-Cell') && panel.id;
}"""

#: The state of the notebook in the panel with id ``id``, read in one call: its input prompts ("[3]:", "[*]:", "[ ]:"),
#: every input prompt of it (a collapsed input's placeholder too), the kernel's state in the status bar (the current
#: notebook's: "Python 3 (ipykernel) | Idle" gives "Idle"; "" while no kernel is attached), and the toolbar's
#: execution indicator's ("busy" until every cell Run All scheduled has run; undefined if the toolbar has none).
#: Locators read the same in about ten times the CPU.
_STATE = """id => {
    const panel = document.getElementById(id);
    const texts = (root, selector) => root ? [...root.querySelectorAll(selector)].map(e => e.textContent.trim()) : [];
    const kernel = texts(document, '.jp-StatusBar-TextItem').map(text => [text, text.lastIndexOf(' | ')])
        .find(([text, bar]) => bar >= 0 && text.slice(0, bar).trim() !== 'No Kernel');
    return {inputs: texts(panel, '.jp-CodeCell .jp-InputArea-prompt'), prompts: texts(panel, '.jp-InputPrompt'),
            kernel: kernel ? kernel[0].slice(kernel[1] + 3).trim() : '',
            indicator: panel?.querySelector('.jp-Notebook-ExecutionIndicator')?.dataset.status};
}"""

#: The waits test their condition in the page itself (page.wait_for_function) this often, in milliseconds: no call
#: from Python and through Playwright's driver per test, and an end is seen within a tenth of a second.
_POLL_MS = 100

#: True once the kernel is attached and idle and no code cell of panel ``id`` is queued or running.
_IDLE = f"""id => {{
    const state = ({_STATE})(id);
    return state.kernel === 'Idle' && !state.prompts.some(text => text.includes('[*]'));
}}"""

#: "done" once every code cell of panel ``id`` has run and the kernel is idle; "stopped" once the kernel has been idle
#: with nothing queued, yet not every cell run, for ``stoppedMs`` (Run All stops at a cell that raises: the cells after
#: it stay "[ ]:"). The input area's own prompts ("inputs"): a collapsed input (a hidden solution) also shows a
#: placeholder whose prompt (.jp-Placeholder-prompt.jp-InputPrompt) stays empty, so all of them never settle. A
#: collapsed input shows no prompt of its own at all, and the status bar says "Idle" for a moment between two cells:
#: only the execution indicator tells that a hidden last cell has yet to run. When the stop began is kept in
#: window.dtlibStoppedSince (run_all clears it).
_RUN_ALL_OVER = rf"""({{id, stoppedMs}}) => {{
    const state = ({_STATE})(id);
    const idle = state.kernel === 'Idle';
    const allRun = state.indicator === undefined || state.indicator === 'idle';
    if (idle && allRun && state.inputs.every(text => /^\[\d+\]:$/.test(text))) return 'done';
    if (!idle || state.inputs.includes('[*]:')) {{
        window.dtlibStoppedSince = undefined;
        return false;
    }}
    window.dtlibStoppedSince ??= Date.now();
    return Date.now() - window.dtlibStoppedSince > stoppedMs ? 'stopped' : false;
}}"""

#: True once the prediction widget of cell ``index`` of panel ``id`` shows a verdict (✓ or ✗ first).
_VERDICT_SHOWN = """({id, index}) => {
    const cell = document.getElementById(id)?.querySelectorAll('.jp-Notebook .jp-Cell')[index];
    const shown = cell && cell.querySelector('.dtlib-prediction .widget-output');
    return !!shown && /^[✓✗]/.test(shown.innerText.trim());
}"""

#: True once panel ``id`` is gone, or a dialog asks something (close() answers it).
_CLOSED_OR_ASKING = "id => !document.getElementById(id) || !!document.querySelector('.jp-Dialog')"


class NotebookPage:
    """One notebook open in JupyterLab in ``page``, in a tab of its own: other notebooks may be open in the page."""

    def __init__(self, page: Page, lab: LabServer, notebook: str, kernel: str = "python3") -> None:
        """Open ``notebook`` from JupyterLab's file browser (a double click, as a learner does) and wait until its
        kernel is idle. ``page`` is new (JupyterLab loads first) or one where JupyterLab already runs. The notebook's
        ``kernel`` starts through the REST API first, so that it starts while the page loads and renders the notebook,
        not after; JupyterLab joins it."""
        self.page = page
        self.lab = lab
        self.notebook = notebook
        lab.start_kernel(notebook, kernel)
        if not page.url.startswith(f"{lab.address}/lab"):  # a new page
            page.goto(lab.url())
        page.locator(".jp-DirListing-content").get_by_text(notebook, exact=True).dblclick(timeout=60_000)
        self.panel_id = str(self._wait(_SHOWN, 60, arg=notebook))
        self.panel = page.locator(f"[id='{self.panel_id}']")
        self.cells = self.panel.locator(".jp-Notebook .jp-Cell")
        self.wait_idle(timeout_s=60)  # the kernel has started

    def _wait(self, condition: str, timeout_s: float, arg: object = None) -> object:
        """Wait until the JavaScript function ``condition`` (called with ``arg``) returns something true in the page,
        and return it; Playwright's TimeoutError after ``timeout_s``."""
        handle = self.page.wait_for_function(condition, arg=arg, polling=_POLL_MS, timeout=max(timeout_s, 0.001) * 1000)
        return handle.json_value()

    def activate(self) -> None:
        """Bring the notebook's tab to the front (a click on it) if another notebook's is there, and wait until it is:
        the status bar and the menus act on the current notebook."""
        tab = self.page.locator(f".lm-TabBar-tab[data-id='{self.panel_id}']")
        if "lm-mod-current" not in (tab.get_attribute("class", timeout=60_000) or "").split():
            tab.click(timeout=60_000)
        self._wait(_SHOWN, 60, arg=self.notebook)

    def kernel_status(self) -> str:
        """The status bar's kernel state: "Idle", "Busy", "Connecting", ...; "" while no kernel is attached.
        (The toolbar's execution indicator says "idle" before the kernel exists, so it cannot be used.)"""
        return self.page.evaluate(_STATE, self.panel_id)["kernel"]

    def wait_idle(self, timeout_s: float) -> None:
        """Wait until the kernel is attached and idle and no code cell is queued or running."""
        try:
            self._wait(_IDLE, timeout_s, arg=self.panel_id)
        except PlaywrightTimeoutError:
            raise TimeoutError(f"{self.notebook}: the kernel was not idle after {timeout_s:.0f} s "
                               f"(status: {self.kernel_status() or 'no kernel'})") from None

    def menu(self, menu: str, item: str) -> None:
        """Click ``item`` in the menu bar's ``menu``, e.g. ``menu("Run", "Run All Cells")``."""
        self.panel.click(position={"x": 5, "y": 5})  # focus the notebook (toolbar edge), so the menu acts on it
        self.page.locator("#jp-MainMenu .lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).click()
        # By its label: an item's accessible name ends with its shortcut, if it has one ("Close Tab Alt+W").
        label = self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$"))
        self.page.get_by_role("menuitem").filter(has=label).click()

    def run_all(self, timeout_s: float) -> float:
        """Edit > Clear Outputs of All Cells, then Run > Run All Cells, as a learner would; wait until every
        code cell has run and the kernel is idle; return the seconds it took. Run All stops at a cell that raises:
        once the kernel has stayed idle with nothing queued for 3 s, this returns too, and the saved notebook
        shows the error (rather than a wait until ``timeout_s``)."""
        self.menu("Edit", "Clear Outputs of All Cells")
        self.page.evaluate("() => { window.dtlibStoppedSince = undefined; }")
        started = time.monotonic()
        self.menu("Run", "Run All Cells")
        try:  # stopped at an error: the caller then reads the error from the saved file
            self._wait(_RUN_ALL_OVER, started + timeout_s - time.monotonic(),
                       arg={"id": self.panel_id, "stoppedMs": 3000})
        except PlaywrightTimeoutError:
            raise TimeoutError(f"{self.notebook}: Run All had not finished after {timeout_s:.0f} s "
                               f"(kernel {self.kernel_status() or 'missing'})") from None
        return time.monotonic() - started

    def images_per_cell(self) -> dict[int, int]:
        """Loaded images per code cell now on the page, by cell index (markdown cells counted in the index);
        cells without images left out."""
        return {index: images for index, images in enumerate(self.panel.evaluate(_COUNT_IMAGES)) if images}

    def save(self, timeout_s: float = 60.0) -> nbformat.NotebookNode:
        """Save through the UI (Ctrl+S) and read back what JupyterLab wrote: the outputs as the kernel sent
        them, errors included. The server answers JupyterLab's PUT once the file is written."""
        address = f"/api/contents/{urllib.parse.quote(self.notebook)}"
        self.panel.click(position={"x": 5, "y": 5})  # the toolbar's edge: focus without touching a cell or widget
        try:
            with self.page.expect_response(
                    lambda response: response.request.method == "PUT" and urllib.parse.urlsplit(response.url).path
                    .endswith(address), timeout=timeout_s * 1000) as saved:
                self.page.keyboard.press("Control+s")
        except PlaywrightTimeoutError:
            raise TimeoutError(f"{self.notebook}: JupyterLab did not save within {timeout_s:.0f} s") from None
        if not saved.value.ok:
            raise RuntimeError(f"{self.notebook}: saving failed: HTTP {saved.value.status} {saved.value.text()[:500]}")
        return nbformat.read(self.lab.root / self.notebook, as_version=4)

    def close(self) -> None:
        """Close the notebook's tab (its × button), as a learner does, and wait until it is gone: JupyterLab stays
        loaded in the page, ready to open the next notebook. Its kernel keeps running (LabServer.shutdown_kernels
        ends it). Changes since save() are discarded if JupyterLab asks; any other question raises."""
        self.page.locator(f".lm-TabBar-tab[data-id='{self.panel_id}'] .lm-TabBar-tabCloseIcon").click(timeout=60_000)
        self._wait(_CLOSED_OR_ASKING, 60, arg=self.panel_id)
        dialog = self.page.locator(".jp-Dialog")
        if dialog.count():
            discard = dialog.locator(".jp-Dialog-button", has_text=re.compile("^Discard$"))
            if not discard.count():
                raise RuntimeError(f"{self.notebook}: closing its tab asks: {dialog.inner_text()}")
            discard.click(timeout=60_000)
            self._wait("id => !document.getElementById(id)", 60, arg=self.panel_id)

    def sliders(self, cell_index: int) -> list[Locator]:
        """Every ipywidgets slider handle in cell ``cell_index`` (noUiSlider handles carry role="slider")."""
        return self.cells.nth(cell_index).locator(".jupyter-widgets").get_by_role("slider").all()

    def widget_figure(self, cell_index: int) -> str | None:
        """The ``src`` (a base64 PNG) of the figure a widget in cell ``cell_index`` draws, or None if none shows."""
        image = self.cells.nth(cell_index).locator(".jupyter-widgets .widget-output img")
        return image.first.get_attribute("src") if image.count() else None

    @staticmethod
    def slider_text(slider: Locator) -> tuple[str, str]:
        """The slider's description and the value its readout shows, e.g. ("nodes", "2")."""
        widget = slider.locator("xpath=ancestor::div[contains(@class, 'widget-slider')]")
        return (widget.locator(".widget-label").inner_text(timeout=120_000),
                widget.locator(".widget-readout").inner_text(timeout=120_000))

    def move_slider(self, slider: Locator) -> str:
        """Focus ``slider`` and press an arrow key once, as a learner using the keyboard would (the left arrow
        when the handle is at its maximum); return the value its readout shows once it changes (or, after
        30 s, the unchanged one). Every wait is explicit and generous (a hang guard): a busy machine may be
        slow, never wrong."""
        before = self.slider_text(slider)[1]
        at_maximum = slider.get_attribute("aria-valuenow", timeout=120_000) == slider.get_attribute(
            "aria-valuemax", timeout=120_000)
        key = "ArrowLeft" if at_maximum else "ArrowRight"
        slider.focus(timeout=120_000)
        slider.press(key, timeout=120_000)
        deadline = time.monotonic() + 30
        while self.slider_text(slider)[1] == before and time.monotonic() < deadline:
            self.page.wait_for_timeout(100)
        return self.slider_text(slider)[1]

    def figure_after(self, cell_index: int, before: str | None, timeout_s: float = 60.0) -> str | None:
        """Wait until the widget figure in cell ``cell_index`` differs from ``before`` and the kernel is idle,
        and return it; after ``timeout_s`` return whatever is shown (``before`` when nothing changed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            shown = self.widget_figure(cell_index)
            if shown is not None and shown != before and self.kernel_status() == "Idle":
                return self.widget_figure(cell_index)
            self.page.wait_for_timeout(200)
        return self.widget_figure(cell_index)

    def predict(self, cell_index: int, guess: str, timeout_s: float = 180.0) -> str:
        """Type ``guess`` into the prediction widget of cell ``cell_index``, press its button, as a learner would,
        and return the verdict it shows (a line that starts with ✓ or ✗) once it does; after ``timeout_s`` (a hang
        guard: the measurement runs ranks), whatever the widget shows."""
        widget = self.cells.nth(cell_index).locator(".dtlib-prediction")
        widget.locator("input").fill(guess, timeout=120_000)
        widget.get_by_role("button", name="measure").click(timeout=120_000)
        with contextlib.suppress(PlaywrightTimeoutError):
            self._wait(_VERDICT_SHOWN, timeout_s, arg={"id": self.panel_id, "index": cell_index})
        return widget.locator(".widget-output").inner_text(timeout=120_000).strip()

    def screenshot(self, path: Path) -> None:
        """A picture of the whole notebook after its run: the window is made as tall as the notebook
        (up to 30,000 pixels) for the shot, then put back."""
        path.parent.mkdir(parents=True, exist_ok=True)
        viewport = self.page.viewport_size or {"width": 1280, "height": 900}
        scroller = self.panel.locator(".jp-WindowedPanel-outer")
        extra = viewport["height"] - scroller.evaluate("e => e.clientHeight")
        height = scroller.evaluate("e => e.scrollHeight") + extra
        self.page.set_viewport_size({"width": viewport["width"], "height": min(height, 30_000)})
        try:
            self.page.wait_for_timeout(300)  # let JupyterLab lay the panel out again
            scroller.evaluate("e => { e.scrollTop = 0; }")  # Run All left it at the last cell
            self.page.wait_for_timeout(200)
            self.page.screenshot(path=str(path))
        finally:
            self.page.set_viewport_size(viewport)


@dataclass
class NotebookRun:
    """One notebook after Run All in the browser."""

    notebook: str
    seconds: float  # Run All Cells, click to idle
    stored: nbformat.NotebookNode  # the notebook as committed
    saved: nbformat.NotebookNode  # what JupyterLab saved after the run
    images: dict[int, int]  # loaded images the page showed, per code cell index
    view: NotebookPage | None  # still open (and its kernel alive) when the notebook has sliders
    verdicts: dict[int, str]  # what each prediction widget said to the guess "1", per code cell index


class NotebookRuns:
    """Runs each notebook at most once per test session and remembers the result.

    Each prediction widget is tried right after Run All (the guess "1"), and its verdict kept. Notebooks with
    sliders stay open so that they can be moved later (their tab is brought to the front then); the others are
    closed and their kernels shut down at once, so that idle kernels do not pile up (an open notebook and its kernel
    slow every later Run All). Each notebook opens in the page of the one before, from the file browser, as a
    learner's would: loading JupyterLab in a new page takes seconds.
    """

    def __init__(self, browser: Browser, lab: LabServer, screenshots: Path, hang_guard_x_budget: float = 5.0,
                 take_screenshots: bool = True) -> None:
        self._lab = lab
        self._screenshots = screenshots  # each run's record goes here, and its picture where one is taken
        self._take_screenshots = take_screenshots
        self.hang_guard_x_budget = hang_guard_x_budget  # Run All may take this many times its budget, then: a hang
        self._runs: dict[str, NotebookRun] = {}
        self._ending: list[threading.Thread] = []  # kernels being shut down while the next notebook starts
        # One browser context for every page: its HTTP and compiled-code caches make each page after the first
        # load JupyterLab's scripts without fetching and compiling them again (each page has a workspace of its
        # own, reset: see LabServer.url).
        self._context = browser.new_context(viewport={"width": 1280, "height": 900})
        self._page: Page | None = None  # JupyterLab, where the next notebook opens (None: in a new page)

    def get(self, notebook: str) -> NotebookRun:
        """The run of ``notebook`` (a file name in notebooks/), running it first if needed."""
        if notebook not in self._runs:
            self._runs[notebook] = self._run(notebook)
        elif (view := self._runs[notebook].view) is not None:
            view.activate()  # later notebooks opened in front of it
        return self._runs[notebook]

    def _run(self, notebook: str) -> NotebookRun:
        stored = nbformat.read(self._lab.root / notebook, as_version=4)
        forget(self._screenshots, notebook)
        page, self._page = self._page or self._context.new_page(), None
        keep = done = False
        try:
            view = NotebookPage(page, self._lab, notebook, stored.metadata.get("kernelspec", {}).get("name", "python3"))
            budget_s = stored.metadata["dtlib"]["time_budget_s"]
            seconds = view.run_all(self.hang_guard_x_budget * budget_s)
            images = view.images_per_cell()
            saved = view.save()
            screenshot = self._screenshots / f"{Path(notebook).stem}.png" if self._take_screenshots else None
            if screenshot is not None:
                view.screenshot(screenshot)
            record(self._screenshots, notebook, seconds, budget_s, screenshot)
            verdicts = {index: self._verdict(view, index) for index in prediction_cells(stored)}
            keep = bool(widget_cells(stored))
            done = True
            return NotebookRun(notebook, seconds, stored, saved, images, view if keep else None, verdicts)
        finally:
            if keep or (done and self._closes(view)):
                self._page = page
            elif not any(run.view is not None and run.view.page is page for run in self._runs.values()):
                page.close()  # after a failure: whatever it shows, the next notebook gets a new page
            if not keep:
                self._shut_down(notebook)

    def _shut_down(self, notebook: str) -> None:
        """Shut ``notebook``'s kernels down in the background: the server waits seconds for a kernel to end, and the
        next notebook need not (close() waits for all)."""
        ending = threading.Thread(target=self._lab.shutdown_kernels, args=(notebook,), daemon=True)
        ending.start()
        self._ending.append(ending)

    @staticmethod
    def _closes(view: NotebookPage) -> bool:
        """Whether ``view`` closed its notebook, leaving JupyterLab ready for the next one."""
        try:
            view.close()
        except Exception:  # noqa: BLE001 - a page that did not close its notebook is simply not reused
            return False
        return True

    @staticmethod
    def _verdict(view: NotebookPage, cell_index: int) -> str:
        """The prediction widget's verdict on "1", or what went wrong in the page (its test shows it)."""
        try:
            return view.predict(cell_index, "1")
        except Exception as error:  # noqa: BLE001 - a page that failed is a verdict to report, not a crash here
            return f"the page failed: {type(error).__name__}: {error}"[:500]

    def close(self) -> None:
        """Close every page still open, and shut every kernel down, all at once, and wait for them (the server stops
        with its kernels anyway, but after the ones already ending)."""
        for page in self._context.pages:
            page.close()
        for run in self._runs.values():
            if run.view is not None:
                self._shut_down(run.notebook)
        for ending in self._ending:
            ending.join(timeout=60)
        self._context.close()
