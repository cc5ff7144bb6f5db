package console

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/deferq/scheduler/internal/console/access"
)

// cookieName is the session cookie's name.
const cookieName = "scheduler_session"

// session is a logged-in user, read from a valid cookie.
type session struct {
	name, role string
	// id is random per login; the CSRF token is derived from it.
	id      string
	expires time.Time
}

func (u *session) operator() bool { return u != nil && u.role == access.Operator }

// Name and Role are for the templates.
func (u *session) Name() string { return u.name }

// Role is the user's role, viewer or operator.
func (u *session) Role() string { return u.role }

// mac signs what with the session key, for one purpose.
func (s *server) mac(purpose, what string) []byte {
	m := hmac.New(sha256.New, s.key)
	m.Write([]byte(purpose + "\x00" + what))
	return m.Sum(nil)
}

// cookieValue is v1|name|expiry|id, base64, a dot, and its HMAC.
func (s *server) cookieValue(u *session) string {
	payload := strings.Join([]string{"v1", u.name, strconv.FormatInt(u.expires.Unix(), 10), u.id}, "|")
	enc := base64.RawURLEncoding
	return enc.EncodeToString([]byte(payload)) + "." + enc.EncodeToString(s.mac("session", payload))
}

// readSession returns the session of r's cookie, or nil when there is none
// or it is forged, expired, or names a user who no longer exists.
func (s *server) readSession(r *http.Request) *session {
	c, err := r.Cookie(cookieName)
	if err != nil {
		return nil
	}
	b64, sig, ok := strings.Cut(c.Value, ".")
	if !ok {
		return nil
	}
	enc := base64.RawURLEncoding
	payload, err1 := enc.DecodeString(b64)
	mac, err2 := enc.DecodeString(sig)
	if err1 != nil || err2 != nil || !hmac.Equal(mac, s.mac("session", string(payload))) {
		return nil
	}
	parts := strings.Split(string(payload), "|")
	if len(parts) != 4 || parts[0] != "v1" {
		return nil
	}
	exp, err := strconv.ParseInt(parts[2], 10, 64)
	if err != nil || time.Now().Unix() >= exp {
		return nil
	}
	// The role is read now: a user removed or demoted loses it at once.
	user, ok := s.users[parts[1]]
	if !ok {
		return nil
	}
	return &session{name: user.Name, role: user.Role, id: parts[3], expires: time.Unix(exp, 0)}
}

// csrfToken is the token every form of u's pages carries.
func (s *server) csrfToken(u *session) string {
	if u == nil {
		return ""
	}
	return hex.EncodeToString(s.mac("csrf", u.id))
}

// checkCSRF refuses a state change whose csrf field is not u's token, or
// that a browser says came from another site.
func (s *server) checkCSRF(r *http.Request, u *session) string {
	if why := sameOrigin(r); why != "" {
		return why
	}
	got := r.PostFormValue("csrf")
	if got == "" {
		return "The form carried no CSRF token (field csrf). Reload the page and submit it again; nothing was changed."
	}
	if subtle.ConstantTimeCompare([]byte(got), []byte(s.csrfToken(u))) != 1 {
		return "The form's CSRF token is not this session's (it may come from an older login or another site). Reload the page and submit it again; nothing was changed."
	}
	return ""
}

// sameOrigin refuses requests a browser marks as coming from another site:
// Sec-Fetch-Site other than same-origin (or none: typed or bookmarked), or
// an Origin that is not this host.
func sameOrigin(r *http.Request) string {
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" && site != "none" {
		return "This request came from another site (Sec-Fetch-Site: " + site + "); nothing was changed."
	}
	if o := r.Header.Get("Origin"); o != "" && o != "null" {
		u, err := url.Parse(o)
		if err != nil || u.Host != r.Host {
			return "This request came from another origin (" + o + "); nothing was changed."
		}
	} else if o == "null" {
		return "This request came from an opaque origin; nothing was changed."
	}
	return ""
}

// authed passes requests with a valid session to h. Without one, a page
// redirects to the login form, and JSON and state changes answer 401.
func (s *server) authed(h func(http.ResponseWriter, *http.Request, *session)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		u := s.readSession(r)
		if u == nil {
			switch {
			case strings.HasPrefix(r.URL.Path, "/api/"):
				writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "not logged in, or the session expired: log in at /login"})
			case r.Method != http.MethodGet && r.Method != http.MethodHead:
				s.render(w, r, http.StatusUnauthorized, "error", page{Title: "Not logged in",
					Error: "You are not logged in, or your session expired. Log in and try again; nothing was changed."})
			default:
				http.Redirect(w, r, "/login?next="+url.QueryEscape(r.URL.RequestURI()), http.StatusSeeOther)
			}
			return
		}
		h(w, r, u)
	}
}

func (s *server) loginPage(w http.ResponseWriter, r *http.Request) {
	s.render(w, r, http.StatusOK, "login", page{Title: "Log in", Data: loginData{Next: safeNext(r.URL.Query().Get("next"))}})
}

type loginData struct {
	Next, User string
}

// safeNext keeps a post-login redirect on this site.
func safeNext(next string) string {
	if !strings.HasPrefix(next, "/") || strings.HasPrefix(next, "//") || strings.HasPrefix(next, "/\\") {
		return "/"
	}
	return next
}

func (s *server) login(w http.ResponseWriter, r *http.Request) {
	if why := sameOrigin(r); why != "" {
		s.render(w, r, http.StatusForbidden, "login", page{Title: "Log in", Error: why, Data: loginData{Next: "/"}})
		return
	}
	name, password := r.PostFormValue("user"), r.PostFormValue("password")
	next := safeNext(r.PostFormValue("next"))
	user, known := s.users[name]
	h := user.Hash
	if !known {
		h = s.dummyHash
	}
	ok := access.Verify(h, password) && known
	if !ok {
		// Slow down guessing; say nothing about which part was wrong.
		time.Sleep(s.cfg.LoginDelay)
		s.logger.Warn("console login failed", "user", name, "remote", r.RemoteAddr)
		s.render(w, r, http.StatusUnauthorized, "login", page{Title: "Log in", Error: "wrong user or password",
			Data: loginData{Next: next, User: name}})
		return
	}
	id := make([]byte, 16)
	if _, err := rand.Read(id); err != nil {
		s.render(w, r, http.StatusInternalServerError, "error", page{Title: "Error", Error: "cannot start a session: " + err.Error()})
		return
	}
	u := &session{name: user.Name, role: user.Role, id: hex.EncodeToString(id), expires: time.Now().Add(s.cfg.SessionTTL)}
	http.SetCookie(w, s.cookie(r, s.cookieValue(u), u.expires))
	s.logger.Info("console login", "user", u.name, "role", u.role, "remote", r.RemoteAddr)
	http.Redirect(w, r, next, http.StatusSeeOther)
}

func (s *server) logout(w http.ResponseWriter, r *http.Request, u *session) {
	if why := s.checkCSRF(r, u); why != "" {
		s.fail(w, r, u, http.StatusForbidden, why)
		return
	}
	http.SetCookie(w, s.cookie(r, "", time.Unix(1, 0)))
	http.Redirect(w, r, "/login", http.StatusSeeOther)
}

func (s *server) cookie(r *http.Request, value string, expires time.Time) *http.Cookie {
	c := &http.Cookie{Name: cookieName, Value: value, Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode,
		Secure: r.TLS != nil || s.cfg.CookieSecure, Expires: expires}
	if value == "" {
		c.MaxAge = -1
	}
	return c
}
