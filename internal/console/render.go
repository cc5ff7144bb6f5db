package console

import (
	"bytes"
	"encoding/json"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/deferq/scheduler/internal/reason"
)

// page is what every template gets.
type page struct {
	Title string
	// Nav names the section the page belongs to, for the menu.
	Nav string
	// User is nil on the login and setup pages.
	User *session
	CSRF string
	// Operator: show action forms.
	Operator bool
	// PayloadPreview: show payloads and header values.
	PayloadPreview bool
	// Error is shown in #error; Notice is a note that is not an error.
	Error, Notice string
	Data          any
}

var pageNames = []string{"setup", "login", "error", "overview", "messages", "message", "key", "parked", "rejected",
	"targets", "preview", "result"}

func parsePages() (map[string]*template.Template, error) {
	funcs := template.FuncMap{
		"ts":        formatTime,
		"tsp":       func(t *time.Time) string { return formatTimePtr(t) },
		"ago":       ago,
		"s":         deref,
		"dash":      func(p *string) string { return orDash(p) },
		"code":      reasonCode,
		"num":       func(n int64) string { return groupDigits(n) },
		"secs":      humanSeconds,
		"rate":      func(r *float64) string { return formatRate(r) },
		"keyURL":    func(k *string) string { return keyURL(k) },
		"msgURL":    func(id int64) string { return "/messages/" + strconv.FormatInt(id, 10) },
		"q":         url.QueryEscape,
		"printable": printable,
	}
	out := map[string]*template.Template{}
	for _, name := range pageNames {
		t, err := template.New(name).Funcs(funcs).ParseFS(assets, "templates/layout.html", "templates/"+name+".html")
		if err != nil {
			return nil, fmt.Errorf("console: template %s: %w", name, err)
		}
		out[name] = t
	}
	return out, nil
}

// render writes the page name, completing p with the session's details.
func (s *server) render(w http.ResponseWriter, r *http.Request, status int, name string, p page) {
	if p.User != nil {
		p.CSRF = s.csrfToken(p.User)
		p.Operator = p.User.operator()
	}
	p.PayloadPreview = s.cfg.PayloadPreview
	var buf bytes.Buffer
	if err := s.pages[name].ExecuteTemplate(&buf, "layout", p); err != nil {
		s.logger.Error("console: render", "page", name, "error", err)
		http.Error(w, "the page could not be rendered: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// fail answers with an error page: the message in #error.
func (s *server) fail(w http.ResponseWriter, r *http.Request, u *session, status int, msg string) {
	title := http.StatusText(status)
	s.render(w, r, status, "error", page{Title: title, User: u, Error: msg})
}

// dbFail answers a database error.
func (s *server) dbFail(w http.ResponseWriter, r *http.Request, u *session, what string, err error) {
	s.logger.Error("console: database", "what", what, "user", u.name, "error", err)
	s.fail(w, r, u, http.StatusInternalServerError, what+": "+err.Error())
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func formatTime(t time.Time) string {
	if t.IsZero() {
		return "—"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

func formatTimePtr(t *time.Time) string {
	if t == nil {
		return "—"
	}
	return formatTime(*t)
}

// ago says how long before (or after) now t is, in words.
func ago(t any) string {
	var tt time.Time
	switch v := t.(type) {
	case time.Time:
		tt = v
	case *time.Time:
		if v == nil {
			return ""
		}
		tt = *v
	default:
		return ""
	}
	d := time.Since(tt)
	if d < 0 {
		return "in " + humanDuration(-d)
	}
	return humanDuration(d) + " ago"
}

func humanSeconds(f float64) string { return humanDuration(time.Duration(f * float64(time.Second))) }

func humanDuration(d time.Duration) string {
	switch {
	case d < time.Second:
		return "0s"
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	default:
		return fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
	}
}

func deref(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}

func orDash(p *string) string {
	if p == nil || *p == "" {
		return "—"
	}
	return *p
}

// reasonCode is the code of a reason (reason.Code), empty when there is none.
func reasonCode(r *string) string {
	if r == nil {
		return ""
	}
	return reason.Code(*r)
}

func groupDigits(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

func formatRate(r *float64) string {
	if r == nil {
		return ""
	}
	return strconv.FormatFloat(*r, 'f', -1, 64)
}

func keyURL(k *string) string {
	if k == nil {
		return ""
	}
	return "/keys?key=" + url.QueryEscape(*k)
}

// printable replaces control characters (which could rewrite a terminal
// copy-pasted into, or hide text) with their escapes; the page's escaping
// takes care of HTML.
func printable(s string) string {
	if !strings.ContainsFunc(s, func(r rune) bool { return r < 0x20 && r != '\n' && r != '\t' || r == 0x7f || r == utf8.RuneError }) {
		return s
	}
	var b strings.Builder
	for _, r := range s {
		if (r < 0x20 && r != '\n' && r != '\t') || r == 0x7f || r == utf8.RuneError {
			q := strconv.QuoteRune(r)
			b.WriteString(q[1 : len(q)-1])
			continue
		}
		b.WriteRune(r)
	}
	return b.String()
}
