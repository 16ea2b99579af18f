"""Drive JupyterLab in a real browser, as a learner does: start a server, open a notebook, Run All, look.

Used by the browser tests in this folder (``make test-browser``). Two parts:

- :class:`LabServer` starts ``jupyter lab`` on 127.0.0.1 with a random free port and token, in a
  temporary copy of ``notebooks/``, with its own settings (every cell kept in the page, no news
  pop-ups), and stops the whole process group afterwards, whatever happened.
- :class:`NotebookPage` wraps a Playwright page showing one notebook: run every cell through the
  Run menu, wait until the kernel is idle, read each cell's outputs and images.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nbformat
import psutil
from playwright.sync_api import Browser, Locator, Page
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
            page.goto(lab.url("00_setup_check.ipynb"))
    """

    def __init__(self, notebooks: Path, workdir: Path, start_timeout_s: float = 60.0) -> None:
        self.root = workdir / "notebooks"
        self.log_path = workdir / "jupyterlab.log"
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self._notebooks = notebooks
        self._workdir = workdir
        self._start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    def url(self, notebook: str) -> str:
        """The address that opens ``notebook`` alone in JupyterLab, token included. Each notebook gets a
        workspace of its own, reset, so that a page does not reopen the notebooks of earlier pages (and
        start their kernels again)."""
        workspace = Path(notebook).stem
        return f"http://127.0.0.1:{self.port}/lab/workspaces/{workspace}/tree/{notebook}?reset&token={self.token}"

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
        status = f"http://127.0.0.1:{self.port}/api/status?token={self.token}"
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
        api = f"http://127.0.0.1:{self.port}/api/sessions"
        headers = {"Authorization": f"token {self.token}"}
        with urllib.request.urlopen(urllib.request.Request(api, headers=headers), timeout=10) as response:
            sessions = json.load(response)
        for session in sessions:
            if session.get("path") == notebook:
                request = urllib.request.Request(f"{api}/{session['id']}", headers=headers, method="DELETE")
                urllib.request.urlopen(request, timeout=30).close()

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


#: What the waits poll, read in one call: the visible notebook's input prompts ("[3]:", "[*]:", "[ ]:"), every
#: input prompt of it (a collapsed input's placeholder too), and the status bar's texts. Locators read the same in
#: about ten times the CPU of the browser and of Playwright's driver, four times a second through every Run All.
_STATE = """() => {
    const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
    const texts = (root, selector) => root ? [...root.querySelectorAll(selector)].map(e => e.textContent.trim()) : [];
    return {inputs: texts(panel, '.jp-CodeCell .jp-InputArea-prompt'), prompts: texts(panel, '.jp-InputPrompt'),
            status: texts(document, '.jp-StatusBar-TextItem')};
}"""


def _kernel_state(status_texts: list[str]) -> str:
    """The kernel's state in the status bar's texts ("Python 3 (ipykernel) | Idle" gives "Idle"); "" without a
    kernel."""
    for text in status_texts:
        name, sep, state = text.rpartition(" | ")
        if sep and name.strip() != "No Kernel":
            return state.strip()
    return ""


class NotebookPage:
    """One notebook open in JupyterLab in ``page``."""

    def __init__(self, page: Page, lab: LabServer, notebook: str) -> None:
        self.page = page
        self.lab = lab
        self.notebook = notebook
        page.goto(lab.url(notebook))
        self.panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
        self.cells = self.panel.locator(".jp-Notebook .jp-Cell")
        self.cells.first.wait_for(timeout=60_000)
        self.wait_idle(timeout_s=60)  # the kernel has started

    def kernel_status(self) -> str:
        """The status bar's kernel state: "Idle", "Busy", "Connecting", ...; "" while no kernel is attached.
        (The toolbar's execution indicator says "idle" before the kernel exists, so it cannot be used.)"""
        return _kernel_state(self.page.evaluate(_STATE)["status"])

    def wait_idle(self, timeout_s: float) -> None:
        """Wait until the kernel is attached and idle and no code cell is queued or running."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.page.evaluate(_STATE)
            if _kernel_state(state["status"]) == "Idle" and not any("[*]" in text for text in state["prompts"]):
                return
            self.page.wait_for_timeout(250)
        raise TimeoutError(f"{self.notebook}: the kernel was not idle after {timeout_s:.0f} s "
                           f"(status: {self.kernel_status() or 'no kernel'})")

    def menu(self, menu: str, item: str) -> None:
        """Click ``item`` in the menu bar's ``menu``, e.g. ``menu("Run", "Run All Cells")``."""
        self.panel.click(position={"x": 5, "y": 5})  # focus the notebook (toolbar edge), so the menu acts on it
        self.page.locator("#jp-MainMenu .lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).click()
        self.page.get_by_role("menuitem", name=item, exact=True).click()

    def run_all(self, timeout_s: float) -> float:
        """Edit > Clear Outputs of All Cells, then Run > Run All Cells, as a learner would; wait until every
        code cell has run and the kernel is idle; return the seconds it took. Run All stops at a cell that raises:
        once the kernel has stayed idle with nothing queued for 3 s, this returns too, and the saved notebook
        shows the error (rather than a wait until ``timeout_s``)."""
        self.menu("Edit", "Clear Outputs of All Cells")
        started = time.monotonic()
        self.menu("Run", "Run All Cells")
        deadline = started + timeout_s
        stopped_since = None  # Run All stops at a cell that raises: the cells after it stay "[ ]:"
        while time.monotonic() < deadline:
            # The input area's own prompts ("inputs"): a collapsed input (a hidden solution) also shows a placeholder
            # whose prompt (.jp-Placeholder-prompt.jp-InputPrompt) stays empty, so all of them never settle.
            state = self.page.evaluate(_STATE)
            texts, idle = state["inputs"], _kernel_state(state["status"]) == "Idle"
            if idle and all(re.fullmatch(r"\[\d+\]:", text) for text in texts):
                return time.monotonic() - started
            if idle and "[*]:" not in texts:  # nothing queued, yet not every cell ran: stopped, if it lasts
                stopped_since = stopped_since or time.monotonic()
                if time.monotonic() - stopped_since > 3:  # the caller then reads the error from the saved file
                    return time.monotonic() - started
            else:
                stopped_since = None
            self.page.wait_for_timeout(250)
        raise TimeoutError(f"{self.notebook}: Run All had not finished after {timeout_s:.0f} s "
                           f"(kernel {self.kernel_status() or 'missing'})")

    def images_per_cell(self) -> dict[int, int]:
        """Loaded images per code cell now on the page, by cell index (markdown cells counted in the index);
        cells without images left out."""
        return {index: images for index, images in enumerate(self.panel.evaluate(_COUNT_IMAGES)) if images}

    def save(self) -> nbformat.NotebookNode:
        """Save through the UI (Ctrl+S) and read back what JupyterLab wrote: the outputs as the kernel sent
        them, errors included."""
        path = self.lab.root / self.notebook
        before = path.stat().st_mtime_ns
        self.panel.click(position={"x": 5, "y": 5})  # the toolbar's edge: focus without touching a cell or widget
        self.page.keyboard.press("Control+s")
        deadline = time.monotonic() + 20
        while path.stat().st_mtime_ns == before:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.notebook}: JupyterLab did not save within 20 s")
            self.page.wait_for_timeout(100)
        self.page.wait_for_timeout(200)  # let the write finish
        return nbformat.read(path, as_version=4)

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
        shown = widget.locator(".widget-output")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = shown.inner_text(timeout=120_000).strip()
            if text.startswith(("✓", "✗")):
                return text
            self.page.wait_for_timeout(250)
        return shown.inner_text(timeout=120_000).strip()

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
    sliders stay open so that they can be moved later; the others are closed and their kernels shut down at once,
    so that idle kernels do not pile up (an open page and its kernel slow every later Run All).
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

    def get(self, notebook: str) -> NotebookRun:
        """The run of ``notebook`` (a file name in notebooks/), running it first if needed."""
        if notebook not in self._runs:
            self._runs[notebook] = self._run(notebook)
        return self._runs[notebook]

    def _run(self, notebook: str) -> NotebookRun:
        stored = nbformat.read(self._lab.root / notebook, as_version=4)
        forget(self._screenshots, notebook)
        page = self._context.new_page()
        keep = False
        try:
            view = NotebookPage(page, self._lab, notebook)
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
            return NotebookRun(notebook, seconds, stored, saved, images, view if keep else None, verdicts)
        finally:
            if not keep:
                page.close()
                # The server waits seconds for a kernel to end: the next notebook need not (close() waits for all)
                ending = threading.Thread(target=self._lab.shutdown_kernels, args=(notebook,), daemon=True)
                ending.start()
                self._ending.append(ending)

    @staticmethod
    def _verdict(view: NotebookPage, cell_index: int) -> str:
        """The prediction widget's verdict on "1", or what went wrong in the page (its test shows it)."""
        try:
            return view.predict(cell_index, "1")
        except Exception as error:  # noqa: BLE001 - a page that failed is a verdict to report, not a crash here
            return f"the page failed: {type(error).__name__}: {error}"[:500]

    def close(self) -> None:
        """Close every page still open, and wait for the kernels being shut down (the server stops with its kernels
        anyway)."""
        for run in self._runs.values():
            if run.view is not None:
                run.view.page.close()
        for ending in self._ending:
            ending.join(timeout=60)
        self._context.close()
