// Package console is the operator console: a small web application, served
// by the scheduler on CONSOLE_ADDR (or alone by `scheduler console`), that
// shows the backlog, messages, keys, the parking lot, rejected records and
// target controls, and acts on them through the same runbook files
// (sql/runbook, via internal/operate) the operator commands run.
//
// Access: users and roles from CONSOLE_USERS (internal/console/access),
// HMAC-signed session cookies, a CSRF token in every form, strict security
// headers. Viewers read, in READ ONLY transactions; operators may also act,
// each action in a transaction that names them (operate.SetActor) so the
// history says who did it. docs/console.md describes it all.
package console

import (
	"context"
	"crypto/rand"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/console/access"
	"github.com/deferq/scheduler/internal/operate"
)

// assets holds the templates and the static files; the only package
// variable, because go:embed needs one; nothing assigns to it.
//
//go:embed templates/*.html static/*
var assets embed.FS

// Config is what the console needs besides its database.
type Config struct {
	// Users may log in. None: every path answers a page saying how to
	// configure access.
	Users []access.User
	// SessionKey signs session cookies (32 bytes or more). Nil: a random key
	// for this process, and a log line saying what that means.
	SessionKey []byte
	// SessionTTL is how long a login lasts; 0: 12h.
	SessionTTL time.Duration
	// CookieSecure marks the cookie Secure even on plain HTTP (behind a
	// proxy that ends TLS); it is always Secure over TLS.
	CookieSecure bool
	// PayloadPreview shows message payloads and header values; false hides
	// them and the pages say so.
	PayloadPreview bool
	// TargetAllowed reports whether TARGET_TOPICS allows a topic, so that
	// replay, fix and pause can warn about a topic dispatch would refuse.
	// Nil: no warning.
	TargetAllowed func(topic string) bool
	// TargetTopics is TARGET_TOPICS as configured, for those warnings.
	TargetTopics string
	// LoginDelay is how long a failed login waits before it answers; 0: 1s.
	LoginDelay time.Duration
	// ConfirmAbove is how many messages a replay may move before the
	// operator must type their number to confirm; 0: 100.
	ConfirmAbove int
	// OverviewEvery is the least time between two counts of the overview,
	// whoever asks; 0: 10s.
	OverviewEvery time.Duration
	// DeferTopic is DEFER_TOPIC, whose ingest progress the overview shows;
	// empty: scheduler.defer.
	DeferTopic string
	// HighWaterMarks returns the defer topic's high-water marks, from which
	// the overview computes how far ingest is behind. Nil: the overview
	// shows how far ingest has stored and when it last moved, and says
	// that the lag is unknown without Kafka.
	HighWaterMarks func() (map[int32]int64, error)
}

// HashPassword returns the hash of password that CONSOLE_USERS takes, as
// `scheduler console hash-password` prints it.
func HashPassword(password string) (string, error) { return access.HashPassword(password) }

// ParseUsers reads users from CONSOLE_USERS-style text: comma-separated
// name:role:hash entries.
func ParseUsers(s string) ([]access.User, error) {
	return access.ParseUsers(access.Entries(s, "", ""))
}

// server is the console: one per New.
type server struct {
	cfg    Config
	pool   *pgxpool.Pool
	logger *slog.Logger
	users  map[string]access.User
	key    []byte
	pages  map[string]*template.Template
	static http.Handler
	// dummyHash is verified against when the user does not exist, so that a
	// wrong name takes as long as a wrong password.
	dummyHash string

	overviewMu sync.Mutex
	overview   *overviewData
}

// New returns the console's handler, reading and acting on pool's
// database. The pool should log in as the operator role of sql/roles.
func New(cfg Config, pool *pgxpool.Pool, logger *slog.Logger) (http.Handler, error) {
	if pool == nil {
		return nil, errors.New("console: no database pool")
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if cfg.SessionTTL <= 0 {
		cfg.SessionTTL = 12 * time.Hour
	}
	if cfg.LoginDelay <= 0 {
		cfg.LoginDelay = time.Second
	}
	if cfg.ConfirmAbove <= 0 {
		cfg.ConfirmAbove = 100
	}
	if cfg.OverviewEvery <= 0 {
		cfg.OverviewEvery = 10 * time.Second
	}
	if cfg.DeferTopic == "" {
		cfg.DeferTopic = "scheduler.defer" // DEFER_TOPIC's default
	}
	s := &server{cfg: cfg, pool: pool, logger: logger, users: map[string]access.User{}}
	for _, u := range cfg.Users {
		if u.Role != access.Viewer && u.Role != access.Operator {
			return nil, fmt.Errorf("console: user %s: role %q: want viewer or operator", u.Name, u.Role)
		}
		s.users[u.Name] = u
	}
	switch {
	case len(cfg.SessionKey) >= 32:
		s.key = cfg.SessionKey
	case len(cfg.SessionKey) > 0:
		return nil, fmt.Errorf("console: session key of %d bytes: want at least 32", len(cfg.SessionKey))
	default:
		s.key = make([]byte, 32)
		if _, err := rand.Read(s.key); err != nil {
			return nil, fmt.Errorf("console: random session key: %w", err)
		}
		if len(s.users) > 0 {
			logger.Warn("CONSOLE_SESSION_KEY is not set: console sessions are signed with a random key, so they end when this process restarts and are not shared between replicas")
		}
	}
	// A real user's hash: verifying a wrong name against it costs what a
	// wrong password does (its result is never used).
	for _, u := range cfg.Users {
		s.dummyHash = u.Hash
	}
	var err error
	if s.pages, err = parsePages(); err != nil {
		return nil, err
	}
	sub, err := fs.Sub(assets, "static")
	if err != nil {
		return nil, fmt.Errorf("console: static files: %w", err)
	}
	files := http.StripPrefix("/static/", http.FileServerFS(sub))
	s.static = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Files only: no directory listing.
		if strings.HasSuffix(r.URL.Path, "/") {
			http.NotFound(w, r)
			return
		}
		files.ServeHTTP(w, r)
	})
	return s.routes(), nil
}

func (s *server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /static/", s.static)
	// Browsers ask for /favicon.ico whatever the page's link says.
	mux.HandleFunc("GET /favicon.ico", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/static/favicon.svg", http.StatusMovedPermanently)
	})
	mux.HandleFunc("GET /login", s.loginPage)
	mux.HandleFunc("POST /login", s.login)
	mux.HandleFunc("POST /logout", s.authed(s.logout))
	mux.HandleFunc("GET /{$}", s.authed(s.overviewPage))
	mux.HandleFunc("GET /api/overview", s.authed(s.overviewJSON))
	mux.HandleFunc("GET /messages", s.authed(s.messagesPage))
	mux.HandleFunc("GET /messages/{id}", s.authed(s.messagePage))
	mux.HandleFunc("GET /keys", s.authed(s.keyPage))
	mux.HandleFunc("GET /parked", s.authed(s.parkedPage))
	mux.HandleFunc("GET /rejected", s.authed(s.rejectedPage))
	mux.HandleFunc("GET /targets", s.authed(s.targetsPage))
	mux.HandleFunc("POST /actions/{action}", s.authed(s.action))
	mux.HandleFunc("/", s.authed(func(w http.ResponseWriter, r *http.Request, u *session) {
		s.fail(w, r, u, http.StatusNotFound, "There is no page "+r.URL.Path+" here.")
	}))
	var h http.Handler = mux
	if len(s.users) == 0 {
		h = http.HandlerFunc(s.noUsers)
	}
	return s.secure(h)
}

// secure adds the security headers to every response.
func (s *server) secure(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "+
			"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'; object-src 'none'")
		h.Set("X-Frame-Options", "DENY")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "same-origin")
		h.Set("Cross-Origin-Opener-Policy", "same-origin")
		if !strings.HasPrefix(r.URL.Path, "/static/") {
			h.Set("Cache-Control", "no-store")
		} else {
			h.Set("Cache-Control", "private, max-age=300")
		}
		next.ServeHTTP(w, r)
	})
}

// noUsers answers every path when no user is configured.
func (s *server) noUsers(w http.ResponseWriter, r *http.Request) {
	if strings.HasPrefix(r.URL.Path, "/static/") && r.Method == http.MethodGet {
		s.static.ServeHTTP(w, r)
		return
	}
	s.render(w, r, http.StatusServiceUnavailable, "setup", page{Title: "Configure access"})
}

// readTx runs fn in a READ ONLY transaction: every page, whoever asks.
func (s *server) readTx(ctx context.Context, fn func(pgx.Tx) error) error {
	return s.tx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly}, "", fn)
}

// writeTx runs fn in a transaction that names the user as the actor of
// what it changes, and commits it if fn succeeds.
func (s *server) writeTx(ctx context.Context, u *session, fn func(pgx.Tx) error) error {
	return s.tx(ctx, pgx.TxOptions{}, "console:"+u.name, fn)
}

// tx runs fn in a transaction with the console's settings: custom plans
// (the runbook's optional filters, "$1 = ” OR col = $1", only use their
// indexes when planned with the values) and a statement timeout.
func (s *server) tx(ctx context.Context, opts pgx.TxOptions, actor string, fn func(pgx.Tx) error) error {
	return pgx.BeginTxFunc(ctx, s.pool, opts, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT set_config('plan_cache_mode', 'force_custom_plan', true), set_config('statement_timeout', '30s', true)"); err != nil {
			return fmt.Errorf("set up the transaction: %w", err)
		}
		if actor != "" {
			if err := operate.SetActor(ctx, tx, actor); err != nil {
				return err
			}
		}
		return fn(tx)
	})
}
