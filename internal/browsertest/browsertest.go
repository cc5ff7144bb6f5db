// Package browsertest drives a headless Chromium from tests, through the
// DevTools protocol (chromedp): the console's browser tests log in, follow
// links, fill and submit forms and read pages as a person would, and take
// the screenshots docs/console.md shows.
//
// Chromium is required, not optional: without it New fails the test with
// how to install it, so that `make test` cannot pass by skipping the browser
// tests on a machine that lacks it. CHROMIUM names another binary (Chrome,
// a headless shell); the default is Debian's /usr/bin/chromium, which
// .ci/run installs.
package browsertest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
)

// DefaultPath is the Chromium binary used when CHROMIUM is not set:
// Debian's chromium package.
const DefaultPath = "/usr/bin/chromium"

// DocsDir is where Screenshot copies its pictures with UPDATE_SCREENSHOTS=1,
// relative to the module's root: the console's documentation shows them.
const DocsDir = "docs/img/console"

// Options says how to start the browser. The zero value is usable.
type Options struct {
	// StepTimeout bounds each step (a navigation and its wait, a click, a
	// read); 0 means 15 seconds. A page that never shows what a step waits
	// for fails the test after this long, not at the test's deadline.
	StepTimeout time.Duration
	// Width and Height are the window's size in CSS pixels; 0 means
	// 1280x800. Screenshots are this wide and as tall as the page.
	Width, Height int
	// UpdateDir is where Screenshot copies its pictures when
	// UPDATE_SCREENSHOTS=1: an absolute directory, or one relative to the
	// module's root (the directory holding go.mod above the test's working
	// directory); "" means DocsDir.
	UpdateDir string
}

// Browser is one headless Chromium with one tab, bound to a test: it is
// closed when the test ends. Its methods fail the test (t.Fatal) when a step
// does not succeed within the step timeout, logging where the page was.
type Browser struct {
	t    testing.TB
	ctx  context.Context // the tab's; every step derives its timeout from it
	opts Options

	mu      sync.Mutex
	console []string // what the page wrote to its console, and uncaught exceptions
}

// ExecPath returns the Chromium binary to run: CHROMIUM when set, else
// DefaultPath. It returns an error saying how to install Chromium when the
// binary is not there.
func ExecPath() (string, error) {
	path, from := os.Getenv("CHROMIUM"), "CHROMIUM"
	if path == "" {
		path, from = DefaultPath, "the default path"
	}
	fi, err := os.Stat(path)
	if err == nil && (fi.IsDir() || fi.Mode().Perm()&0o111 == 0) {
		err = errors.New("not an executable file")
	}
	if err != nil {
		return "", fmt.Errorf("no Chromium at %s (%s): %w; the browser tests need it: install Debian's chromium "+
			"(apt-get install chromium; .ci/run does), or set CHROMIUM to a Chromium or Chrome binary", path, from, err)
	}
	return path, nil
}

// New starts a headless Chromium for t, with a fresh profile, and opens a
// blank tab. It fails the test when Chromium is missing or does not start.
func New(t testing.TB, opts Options) *Browser {
	t.Helper()
	if opts.StepTimeout <= 0 {
		opts.StepTimeout = 15 * time.Second
	}
	if opts.Width <= 0 || opts.Height <= 0 {
		opts.Width, opts.Height = 1280, 800
	}
	path, err := ExecPath()
	if err != nil {
		t.Fatal(err)
	}
	// As root on a closed network: no sandbox (it needs user namespaces),
	// no GPU, nothing that phones home. No --user-data-dir: chromedp then
	// makes a fresh one and removes it, after the browser's helper
	// processes are gone, when the allocator is cancelled.
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(path),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("disable-default-apps", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("disable-features", "Translate,MediaRouter,OptimizationHints"),
		chromedp.Flag("metrics-recording-only", true),
		chromedp.Flag("hide-scrollbars", true),
		chromedp.Flag("force-color-profile", "srgb"),
		chromedp.Flag("password-store", "basic"),
		chromedp.WindowSize(opts.Width, opts.Height),
	)
	b := &Browser{t: t, opts: opts}
	ctx, cancelTab := chromedp.NewContext(allocCtx, chromedp.WithErrorf(func(format string, args ...any) {
		b.note("chromedp: " + fmt.Sprintf(format, args...))
	}))
	t.Cleanup(func() {
		cancelTab()
		cancelAlloc() // waits for the browser to exit and its profile to go
	})
	// The first run starts the browser and binds it to ctx, so it cannot
	// carry a timeout of its own (the browser would die with it): bound it
	// from outside instead.
	started := make(chan error, 1)
	go func() { started <- chromedp.Do(ctx) }()
	select {
	case err := <-started:
		if err != nil {
			t.Fatalf("start Chromium %s: %v", path, err)
		}
	case <-time.After(60 * time.Second):
		cancelTab()
		t.Fatalf("start Chromium %s: no tab after 60s", path)
	}
	b.ctx = ctx
	go b.collectConsole()
	return b
}

// collectConsole keeps what the page writes to its console until the tab
// closes, for Console and for the log of a failed step.
func (b *Browser) collectConsole() {
	for m, err := range chromedp.Console(b.ctx) {
		if err != nil {
			return
		}
		s := m.String()
		if m.URL != "" && !strings.Contains(s, m.URL) {
			s += " (" + m.URL + ")"
		}
		b.note(s)
	}
}

func (b *Browser) note(s string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.console = append(b.console, s)
}

// Console returns what the pages wrote to the browser's console so far,
// uncaught exceptions included, oldest first.
func (b *Browser) Console() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.console...)
}

// Context returns the tab's chromedp context, for actions this package has
// no helper for; bound them with a timeout of their own.
func (b *Browser) Context() context.Context { return b.ctx }

// Run runs actions in the tab within one step timeout and fails the test,
// naming what, if they do not succeed.
func (b *Browser) Run(what string, actions ...chromedp.Action[chromedp.Void]) {
	b.t.Helper()
	if err := b.run(actions...); err != nil {
		b.fail(what, err)
	}
}

func (b *Browser) run(actions ...chromedp.Action[chromedp.Void]) error {
	ctx, cancel := context.WithTimeout(b.ctx, b.opts.StepTimeout)
	defer cancel()
	return chromedp.Do(ctx, actions...)
}

// fail ends the test with err and where the browser was: its location, the
// start of the page's text and what the page wrote to its console.
func (b *Browser) fail(what string, err error) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 5*time.Second)
	defer cancel()
	loc, _ := chromedp.Run(ctx, chromedp.Location())
	text, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`document.body ? document.body.innerText : ""`))
	if len(text) > 2000 {
		text = text[:2000] + "..."
	}
	console := strings.Join(b.Console(), "\n  ")
	b.t.Fatalf("browser: %s: %v\nat %s\npage text:\n%s\nconsole:\n  %s", what, err, loc, text, console)
}

// Open navigates to url and waits until the element sel (CSS) is visible.
func (b *Browser) Open(url, sel string) {
	b.t.Helper()
	b.Run(fmt.Sprintf("open %s and wait for %s", url, sel),
		chromedp.Navigate(url), chromedp.WaitVisible(chromedp.CSS(sel)))
}

// WaitVisible waits until the element sel (CSS) is visible.
func (b *Browser) WaitVisible(sel string) {
	b.t.Helper()
	b.Run("wait for "+sel, chromedp.WaitVisible(chromedp.CSS(sel)))
}

// WaitGone waits until no element matches sel (CSS).
func (b *Browser) WaitGone(sel string) {
	b.t.Helper()
	b.Run("wait for "+sel+" to go", chromedp.WaitNotPresent(chromedp.CSS(sel)))
}

// Click clicks the element sel (CSS) once it is visible, and returns at
// once: for a click the page answers in place.
func (b *Browser) Click(sel string) {
	b.t.Helper()
	b.Run("click "+sel, chromedp.Click(chromedp.CSS(sel)))
}

// ClickLoad clicks the element sel (CSS), a link or a submit button, and
// waits for the page it leads to to load, so that the next step reads the
// new page and not the old one.
func (b *Browser) ClickLoad(sel string) {
	b.t.Helper()
	b.Run("click "+sel+" and wait for the next page", func(ctx context.Context, t *chromedp.Target) (chromedp.Void, error) {
		_, err := chromedp.WaitEvent(page.LoadEventFired, nil, chromedp.Click(chromedp.CSS(sel)))(ctx, t)
		return chromedp.Void{}, err
	})
}

// Fill sets the fields of the form sel (CSS) by name, as typing would: each
// field's value is replaced and it gets the input and change events. A
// checkbox or radio button is checked for "on", "true" or its own value,
// unchecked otherwise. It fails the test naming a field the form lacks.
func (b *Browser) Fill(sel string, fields map[string]string) {
	b.t.Helper()
	arg, err := json.Marshal(map[string]any{"form": sel, "fields": fields})
	if err != nil {
		b.t.Fatalf("browser: fill %s: %v", sel, err)
	}
	missing, err := b.eval(`(() => {
  const a = `+string(arg)+`;
  const form = document.querySelector(a.form);
  if (!form) return ["the form itself"];
  const missing = [];
  for (const [name, value] of Object.entries(a.fields)) {
    const els = form.querySelectorAll('[name="' + CSS.escape(name) + '"]');
    if (els.length === 0) { missing.push(name); continue; }
    for (const el of els) {
      if (el.type === "checkbox" || el.type === "radio") {
        el.checked = value === "on" || value === "true" || value === el.value;
      } else {
        el.value = value;
      }
      el.dispatchEvent(new Event("input", {bubbles: true}));
      el.dispatchEvent(new Event("change", {bubbles: true}));
    }
  }
  return missing;
})()`, sel)
	if err != nil {
		b.fail("fill "+sel, err)
	}
	var names []string
	if err := json.Unmarshal(missing, &names); err != nil {
		b.fail("fill "+sel, err)
	}
	if len(names) > 0 {
		b.fail("fill "+sel, fmt.Errorf("no field named %s", strings.Join(names, ", ")))
	}
}

// eval evaluates a JavaScript expression once visible sel (CSS) is there,
// and returns its value as JSON.
func (b *Browser) eval(js, sel string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(b.ctx, b.opts.StepTimeout)
	defer cancel()
	if _, err := chromedp.Run(ctx, chromedp.Query(chromedp.CSS(sel), chromedp.NodeVisible)); err != nil {
		return nil, err
	}
	return chromedp.Run(ctx, chromedp.Evaluate[[]byte](js))
}

// Text returns the visible text (innerText) of the element sel (CSS), once
// it is there.
func (b *Browser) Text(sel string) string {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, b.opts.StepTimeout)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel), chromedp.NodeVisible))
	if err != nil {
		b.fail("read the text of "+sel, err)
	}
	return s
}

// Texts returns the visible text of every element matching sel (CSS) now,
// in document order; none is an empty slice, not a failure.
func (b *Browser) Texts(sel string) []string {
	b.t.Helper()
	var out []string
	b.Eval(`Array.from(document.querySelectorAll(`+quote(sel)+`), e => e.innerText)`, &out)
	return out
}

// Count returns how many elements match sel (CSS) now, without waiting.
func (b *Browser) Count(sel string) int {
	b.t.Helper()
	var n int
	b.Eval(`document.querySelectorAll(`+quote(sel)+`).length`, &n)
	return n
}

// Attr returns the attribute name of the first element matching sel (CSS),
// once it is there; "" when it has none.
func (b *Browser) Attr(sel, name string) string {
	b.t.Helper()
	var v string
	b.Run("wait for "+sel, chromedp.WaitReady(chromedp.CSS(sel)))
	b.Eval(`(document.querySelector(`+quote(sel)+`).getAttribute(`+quote(name)+`) || "")`, &v)
	return v
}

// Eval evaluates a JavaScript expression in the page (a promise is awaited)
// and decodes its JSON value into out (nil: ignored).
func (b *Browser) Eval(js string, out any) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, b.opts.StepTimeout)
	defer cancel()
	raw, err := chromedp.Run(ctx, chromedp.Evaluate[[]byte](js, chromedp.EvalAwaitPromise))
	if err != nil {
		b.fail("evaluate "+abbrev(js), err)
	}
	if out == nil {
		return
	}
	if err := json.Unmarshal(raw, out); err != nil {
		b.fail("evaluate "+abbrev(js), fmt.Errorf("decode %s: %w", raw, err))
	}
}

// Location returns the tab's current URL.
func (b *Browser) Location() string {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, b.opts.StepTimeout)
	defer cancel()
	loc, err := chromedp.Run(ctx, chromedp.Location())
	if err != nil {
		b.fail("read the location", err)
	}
	return loc
}

// Poll evaluates the JavaScript expression cond every 100ms until it is
// truthy, reloading the page before each try when reload is set (for pages
// that show a state as it was when served), and fails the test after
// within.
func (b *Browser) Poll(what, cond string, reload bool, within time.Duration) {
	b.t.Helper()
	deadline := time.Now().Add(within)
	for {
		if reload {
			if err := b.run(chromedp.Reload()); err != nil {
				b.fail(what, err)
			}
		}
		var ok bool
		b.Eval(`!!(`+cond+`)`, &ok)
		if ok {
			return
		}
		if time.Now().After(deadline) {
			b.fail(what, fmt.Errorf("%s still false after %v", cond, within))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Screenshot saves a PNG of the whole page (its full height, the window's
// width) as name.png in the test's temporary directory, and also in
// Options.UpdateDir (docs/img/console by default) when UPDATE_SCREENSHOTS=1,
// and returns the temporary file's path. Names are file names: letters,
// digits, '-' and '_'.
func (b *Browser) Screenshot(name string) string {
	b.t.Helper()
	if name == "" || strings.Trim(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_") != "" {
		b.t.Fatalf("browser: screenshot name %q: want letters, digits, '-' and '_'", name)
	}
	ctx, cancel := context.WithTimeout(b.ctx, b.opts.StepTimeout)
	defer cancel()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		b.fail("screenshot "+name, err)
	}
	path := filepath.Join(b.t.TempDir(), name+".png")
	if err := os.WriteFile(path, png, 0o644); err != nil {
		b.t.Fatalf("browser: screenshot %s: %v", name, err)
	}
	if os.Getenv("UPDATE_SCREENSHOTS") == "1" {
		dir, err := b.updateDir()
		if err != nil {
			b.t.Fatalf("browser: screenshot %s: %v", name, err)
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			b.t.Fatalf("browser: screenshot %s: %v", name, err)
		}
		if err := os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644); err != nil {
			b.t.Fatalf("browser: screenshot %s: %v", name, err)
		}
		b.t.Logf("screenshot %s written to %s", name, filepath.Join(dir, name+".png"))
	}
	return path
}

// updateDir resolves Options.UpdateDir against the module's root.
func (b *Browser) updateDir() (string, error) {
	dir := b.opts.UpdateDir
	if dir == "" {
		dir = DocsDir
	}
	if filepath.IsAbs(dir) {
		return dir, nil
	}
	root, err := moduleRoot()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, dir), nil
}

// moduleRoot returns the nearest directory at or above the working
// directory (a test's is its package's) that holds go.mod.
func moduleRoot() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("find the module's root: %w", err)
	}
	for dir := wd; ; dir = filepath.Dir(dir) {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		if filepath.Dir(dir) == dir {
			return "", fmt.Errorf("find the module's root: no go.mod at or above %s", wd)
		}
	}
}

// quote makes s a JavaScript string literal.
func quote(s string) string {
	b, _ := json.Marshal(s) // a string always marshals
	return string(b)
}

func abbrev(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 80 {
		return s[:80] + "..."
	}
	return s
}
