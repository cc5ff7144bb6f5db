package browsertest

import (
	"bytes"
	"fmt"
	"image/png"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// testSite serves two pages: / has a button whose click changes a text, a form
// that posts to /echo, and a link to /echo; /echo shows what it was sent.
func testSite(t *testing.T) *httptest.Server {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `<!doctype html><html><head><title>browsertest</title></head><body>
<h1 id="status">waiting</h1>
<button id="go" onclick="document.getElementById('status').textContent = 'clicked'">go</button>
<form id="f" method="post" action="/echo">
  <input name="who"><select name="how"><option value="a">a</option><option value="b">b</option></select>
  <input type="checkbox" name="sure" value="yes">
  <button id="send" type="submit">send</button>
</form>
<ul><li class="item">one</li><li class="item">two</li></ul>
<a id="next" href="/echo?who=link">next</a>
<div style="height: 1500px">tall</div>
</body></html>`)
	})
	mux.HandleFunc("/echo", func(w http.ResponseWriter, r *http.Request) {
		if err := r.ParseForm(); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		fmt.Fprintf(w, `<!doctype html><body><p id="echo">%s %s %s %s</p></body>`,
			r.Method, r.Form.Get("who"), r.Form.Get("how"), r.Form.Get("sure"))
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

func TestBrowser(t *testing.T) {
	srv := testSite(t)
	b := New(t, Options{})

	b.Open(srv.URL, "#go")
	if got := b.Text("#status"); got != "waiting" {
		t.Fatalf("before the click the status reads %q, want waiting", got)
	}
	b.Click("#go")
	b.Poll("the click changes the status", `document.getElementById("status").textContent === "clicked"`, false, 5*time.Second)
	if got := b.Text("#status"); got != "clicked" {
		t.Errorf("after the click the status reads %q, want clicked", got)
	}
	if got := b.Texts("li.item"); strings.Join(got, ",") != "one,two" {
		t.Errorf("Texts(li.item) = %q, want one, two", got)
	}
	if n := b.Count("li.item"); n != 2 {
		t.Errorf("Count(li.item) = %d, want 2", n)
	}
	if n := b.Count("table"); n != 0 {
		t.Errorf("Count(table) = %d, want 0", n)
	}
	if got := b.Attr("#next", "href"); got != "/echo?who=link" {
		t.Errorf("Attr(#next, href) = %q", got)
	}

	// A screenshot is a PNG of the whole page, the window wide.
	t.Setenv("UPDATE_SCREENSHOTS", "1")
	update := t.TempDir()
	b.opts.UpdateDir = update
	path := b.Screenshot("front")
	for _, p := range []string{path, filepath.Join(update, "front.png")} {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		img, err := png.Decode(bytes.NewReader(data))
		if err != nil {
			t.Fatalf("screenshot %s is not a PNG: %v", p, err)
		}
		if w, h := img.Bounds().Dx(), img.Bounds().Dy(); w != 1280 || h < 1500 {
			t.Errorf("screenshot %s is %dx%d, want 1280 wide and the page's full height (over 1500)", p, w, h)
		}
	}

	// A form filled and submitted, and a link followed, lead to the next page.
	b.Fill("#f", map[string]string{"who": "ada", "how": "b", "sure": "on"})
	b.ClickLoad("#send")
	if got := b.Text("#echo"); got != "POST ada b yes" {
		t.Errorf("the form posted %q, want POST ada b yes", got)
	}
	b.Open(srv.URL, "#next")
	b.ClickLoad("#next")
	if got := b.Text("#echo"); got != "GET link" {
		t.Errorf("the link led to %q, want GET link", got)
	}
	if loc := b.Location(); loc != srv.URL+"/echo?who=link" {
		t.Errorf("Location() = %q", loc)
	}

	var sum int
	b.Eval(`fetch("/echo?who=fetched").then(r => r.status + 1)`, &sum)
	if sum != 201 {
		t.Errorf("a fetch from the page answered %d, want 200", sum-1)
	}
}

// fatalTB stands in for a test, so that the failures of a Browser's steps
// can be checked: Fatal records the message and ends the goroutine, as
// testing.T's does.
type fatalTB struct {
	testing.TB
	mu  sync.Mutex
	msg string
}

func (f *fatalTB) Fatal(args ...any) { f.Fatalf("%s", fmt.Sprint(args...)) }
func (f *fatalTB) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.msg = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}

// fails runs step on b with a stand-in test and returns its failure, ""
// when it did not fail.
func fails(b *Browser, step func(*Browser)) string {
	f := &fatalTB{TB: b.t}
	real := b.t
	b.t = f
	defer func() { b.t = real }()
	done := make(chan struct{})
	go func() {
		defer close(done)
		step(b)
	}()
	<-done
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.msg
}

func TestBrowserFailures(t *testing.T) {
	srv := testSite(t)
	b := New(t, Options{StepTimeout: 2 * time.Second})
	b.Open(srv.URL, "#go")
	for _, tc := range []struct {
		name string
		step func(*Browser)
		want []string // in the failure message
	}{
		{"element never shows", func(b *Browser) { b.WaitVisible("#absent") }, []string{"wait for #absent", "deadline", srv.URL, "waiting"}},
		{"form lacks a field", func(b *Browser) { b.Fill("#f", map[string]string{"who": "x", "nope": "y"}) }, []string{"fill #f", "no field named nope"}},
		{"no such form", func(b *Browser) { b.Fill("#g", map[string]string{"who": "x"}) }, []string{"fill #g"}},
		{"condition stays false", func(b *Browser) { b.Poll("never", "false", false, 300*time.Millisecond) }, []string{"never", "still false"}},
		{"script throws", func(b *Browser) { b.Eval("undefinedThing.x", nil) }, []string{"evaluate undefinedThing.x", "ReferenceError"}},
		{"bad screenshot name", func(b *Browser) { b.Screenshot("../x") }, []string{`screenshot name "../x"`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg := fails(b, tc.step)
			if msg == "" {
				t.Fatal("the step did not fail the test")
			}
			for _, w := range tc.want {
				if !strings.Contains(msg, w) {
					t.Errorf("failure %q does not mention %q", msg, w)
				}
			}
		})
	}
}

func TestExecPath(t *testing.T) {
	dir := t.TempDir()
	notExec := filepath.Join(dir, "chrome-not-executable")
	if err := os.WriteFile(notExec, []byte("#!/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(dir, "chrome")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, env, want, wantErr string
	}{
		{"missing binary", filepath.Join(dir, "absent"), "", "apt-get install chromium"},
		{"not executable", notExec, "", "not an executable file"},
		{"a directory", dir, "", "set CHROMIUM"},
		{"an executable", exe, exe, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("CHROMIUM", tc.env)
			got, err := ExecPath()
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !strings.Contains(err.Error(), tc.env) {
					t.Fatalf("ExecPath() error = %v, want one naming %s and saying %q", err, tc.env, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("ExecPath() = %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}
