package console

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/cmdflag"
	"github.com/deferq/scheduler/internal/config"
	"github.com/deferq/scheduler/internal/keygate"
	"github.com/deferq/scheduler/internal/pgconnect"
)

// FromConfig is the console's Config as the service's configuration sets
// it (CONSOLE_*, TARGET_TOPICS).
func FromConfig(c *config.Config) Config {
	return Config{Users: c.ConsoleUserList(), SessionKey: c.ConsoleKey(), SessionTTL: c.ConsoleSessionTTL,
		CookieSecure: c.ConsoleCookieSecure, PayloadPreview: c.ConsolePayloadPreview,
		TargetAllowed: c.Targets().Allows, TargetTopics: c.TargetTopics, DeferTopic: c.DeferTopic}
}

// consoleURL names the console's connection string in messages.
const consoleURL = "CONSOLE_DATABASE_URL or DATABASE_URL"

// OpenPool connects to the console's database (CONSOLE_DATABASE_URL, else
// DATABASE_URL) with a pool of its own, so that people looking at pages
// never take the connections ingest and dispatch need. Its sessions are
// checked as the service's are (internal/pgconnect); its actions write, so
// it wants a server that takes writes.
func OpenPool(ctx context.Context, dbURL string) (*pgxpool.Pool, error) {
	p, err := pgconnect.Open(ctx, dbURL, pgconnect.Options{
		Source: consoleURL, AppName: "defer-scheduler-console", AppNameFixed: true, MaxConns: 4})
	if err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	return p.Pool, nil
}

// Server is a console served on its own address.
type Server struct {
	pool     *pgxpool.Pool
	http     *http.Server
	listener net.Listener
	// stopWatch stops the check that the database still takes writes.
	stopWatch context.CancelFunc
	watched   chan struct{}
}

// Start opens the console's pool, listens on addr and serves the console
// until Close.
// highWaterMarks, if not nil, reads the defer topic's high-water marks,
// for the overview's ingest lag.
func Start(ctx context.Context, c *config.Config, addr string, highWaterMarks func() (map[int32]int64, error), logger *slog.Logger) (*Server, error) {
	pool, err := OpenPool(ctx, c.ConsoleDB())
	if err != nil {
		return nil, err
	}
	cfg := FromConfig(c)
	cfg.HighWaterMarks = highWaterMarks
	h, err := New(cfg, pool, logger)
	if err != nil {
		pool.Close()
		return nil, err
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("CONSOLE_ADDR=%s: %w", addr, err)
	}
	s := &Server{pool: pool, listener: l, http: &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second},
		watched: make(chan struct{})}
	// As the service's readiness does: a primary demoted in place keeps
	// the pool's sessions, and every action would fail on them until
	// they aged out.
	var wctx context.Context
	wctx, s.stopWatch = context.WithCancel(context.WithoutCancel(ctx))
	go func() {
		defer close(s.watched)
		pgconnect.WatchWritable(wctx, pool, consoleURL, c.MetricsInterval, logger.With("component", "console"))
	}()
	go func() {
		if err := s.http.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("console stopped serving", "error", err)
		}
	}()
	if len(c.ConsoleUserList()) == 0 {
		logger.Warn("the console has no users (CONSOLE_USERS, CONSOLE_USERS_FILE): it serves only a page saying how to configure access")
	}
	logger.Info("serving the console", "addr", l.Addr().String(), "users", len(c.ConsoleUserList()))
	return s, nil
}

// Addr is where the console listens.
func (s *Server) Addr() net.Addr { return s.listener.Addr() }

// Close stops serving, waiting up to timeout for requests in progress,
// and closes the pool.
func (s *Server) Close(timeout time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := s.http.Shutdown(ctx); err != nil {
		s.http.Close()
	}
	s.stopWatch()
	<-s.watched
	s.pool.Close()
}

const commandHelp = `Usage: scheduler console [--addr HOST:PORT]
       scheduler console hash-password

Serves the operator console alone, against DATABASE_URL (or
CONSOLE_DATABASE_URL), without ingesting or dispatching: for a laptop, or a
console apart from the service. It listens on --addr, else CONSOLE_ADDR, else
127.0.0.1:8081, until SIGINT or SIGTERM. "scheduler run" serves the same
console on CONSOLE_ADDR when that is set.

Users log in with the entries of CONSOLE_USERS (comma-separated) and
CONSOLE_USERS_FILE (one per line): name:role:hash, role viewer (reads
everything) or operator (may also act), hash as "scheduler console
hash-password" prints it. With no user it serves only a page saying how to
configure access. Set CONSOLE_SESSION_KEY (64 hex digits) so that logins
survive restarts. CONSOLE_PAYLOAD_PREVIEW=false hides payloads and header
values. With KAFKA_BROKERS set (and DEFER_TOPIC, default scheduler.defer),
the overview also shows how many records wait to be ingested. See docs/console.md, and "scheduler run --help" for every variable.

hash-password reads a password from the first line of standard input and
prints its hash (PBKDF2-SHA256, 600000 rounds, random salt):
  scheduler console hash-password
  printf '%s\n' "$PASSWORD" | scheduler console hash-password

Exit code: 0 after a clean stop; 1 when the database cannot be reached or
the address cannot be listened on; 2 for a usage or configuration error.

Flags:
`

// Command is `scheduler console`: it serves the console alone until ctx is
// done, or with hash-password prints a password's hash. It returns the exit
// code.
func Command(ctx context.Context, args, environ []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "hash-password" {
		return hashPasswordCommand(args[1:], stdin, stdout, stderr)
	}
	fs := flag.NewFlagSet("console", flag.ContinueOnError)
	addr := fs.String("addr", "", "listen here (host:port); default: CONSOLE_ADDR, else 127.0.0.1:8081")
	if done, code := cmdflag.Parse(fs, args, stdout, stderr, func(w io.Writer) { _, _ = io.WriteString(w, commandHelp) }); done {
		return code
	}
	cfg, err := config.Load(environ)
	if cfg.ConsoleDB() == "" {
		err = errors.Join(err, errors.New("DATABASE_URL is not set (nor CONSOLE_DATABASE_URL): want a PostgreSQL URL, e.g. postgres://user:pass@host:5432/db"))
	}
	listen := *addr
	if listen == "" {
		listen = cfg.ConsoleAddr
	}
	if listen == "" {
		listen = "127.0.0.1:8081"
	}
	if _, _, perr := net.SplitHostPort(listen); perr != nil {
		err = errors.Join(err, fmt.Errorf("--addr %q is not valid (%v): want host:port, e.g. 127.0.0.1:8081", listen, perr))
	}
	if err != nil {
		fmt.Fprintf(stderr, "scheduler console: configuration:\n%v\n", cmdflag.Indent(err))
		return 2
	}
	logger := cfg.Logger(stderr)
	marks := &kafkaMarks{topic: cfg.DeferTopic}
	srv, err := Start(ctx, &cfg, listen, marks.get, logger)
	if err != nil {
		fmt.Fprintf(stderr, "scheduler console: %v\n", err)
		return 1
	}
	if len(cfg.KafkaBrokers) > 0 {
		// In the background: a broker that does not answer must not keep
		// the console from serving what the database knows.
		go marks.connect(ctx, &cfg, logger)
		defer marks.close()
	}
	fmt.Fprintf(stdout, "console: http://%s/\n", srv.Addr())
	<-ctx.Done()
	srv.Close(5 * time.Second)
	return 0
}

func hashPasswordCommand(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("console hash-password", flag.ContinueOnError)
	if done, code := cmdflag.Parse(fs, args, stdout, stderr, func(w io.Writer) { _, _ = io.WriteString(w, commandHelp) }); done {
		return code
	}
	fmt.Fprint(stderr, "password: ")
	line, err := bufio.NewReader(stdin).ReadString('\n')
	fmt.Fprintln(stderr)
	if err != nil && !errors.Is(err, io.EOF) {
		fmt.Fprintf(stderr, "scheduler console hash-password: read the password: %v\n", err)
		return 1
	}
	password := strings.TrimRight(line, "\r\n")
	if password == "" {
		fmt.Fprintln(stderr, "scheduler console hash-password: the password is empty: type it on the first line of standard input")
		return 2
	}
	h, err := HashPassword(password)
	if err != nil {
		fmt.Fprintf(stderr, "scheduler console hash-password: %v\n", err)
		return 1
	}
	fmt.Fprintln(stdout, h)
	return 0
}

// kafkaMarks reads the defer topic's high-water marks for the standalone
// console, once it has connected to KAFKA_BROKERS.
type kafkaMarks struct {
	topic  string
	client atomic.Pointer[sarama.Client]
}

func (k *kafkaMarks) connect(ctx context.Context, c *config.Config, logger *slog.Logger) {
	sc, err := c.Kafka().Config()
	if err == nil {
		var client sarama.Client
		if client, err = sarama.NewClient(c.KafkaBrokers, sc); err == nil {
			if ctx.Err() != nil {
				client.Close()
				return
			}
			k.client.Store(&client)
			return
		}
	}
	logger.Warn("console: cannot connect to KAFKA_BROKERS; the overview shows ingest's progress without its lag", "error", err)
}

func (k *kafkaMarks) get() (map[int32]int64, error) {
	p := k.client.Load()
	if p == nil {
		return nil, errors.New("not connected to Kafka (scheduler console reads the lag only with KAFKA_BROKERS set and reachable)")
	}
	return keygate.KafkaOffsets{Client: *p}.HighWaterMarks(k.topic)
}

func (k *kafkaMarks) close() {
	if p := k.client.Load(); p != nil {
		(*p).Close()
	}
}
