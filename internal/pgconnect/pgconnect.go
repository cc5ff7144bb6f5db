// Package pgconnect opens the scheduler's connections to PostgreSQL, one
// way for every program (the service, the console, migrate and the
// operator commands), and checks at start what each session must be:
//
//   - READ COMMITTED: the head triggers read again after taking locks and
//     must see what committed meanwhile (docs/design.md, "Only in READ
//     COMMITTED"). The server's default is asked once; only a stricter one
//     is overridden, with a startup parameter, so that a pooler that
//     refuses parameters it does not know (PgBouncer, RDS Proxy, ...) is
//     sent none where the default is already right, as it almost always
//     is. Where a pooler refuses the override, the error says to set the
//     default for the role on the server.
//   - Firing triggers: session_replication_role = replica switches the
//     head triggers off, and a message stored so has no head and is never
//     delivered.
//   - Taking writes, where the program writes: not a hot standby.
//
// It also finds out whether the connection string leads through a pooler
// in transaction mode, where a client's transactions run on whichever
// server session is free: session state (LISTEN, a session advisory lock,
// a named prepared statement) does not stay with the client there. Such a
// pool uses pgx's exec mode unless the string chooses a mode itself, and
// the callers that need a session (migrate, LISTEN) refuse it.
package pgconnect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/pgsession"
	"github.com/deferq/scheduler/sql/queries"
)

// Options say how to open a connection and how to speak of it.
type Options struct {
	// Source names where the connection string came from, for messages:
	// "DATABASE_URL", say.
	Source string
	// AppName is the sessions' application_name unless the connection
	// string names one, or always with AppNameFixed.
	AppName      string
	AppNameFixed bool
	// MaxConns bounds a pool; 0 keeps pgx's default.
	MaxConns int32
	// Timeout bounds connecting and the checks; 0 means 10 seconds.
	Timeout time.Duration
	// AllowReadOnly lets a server that takes no writes through, for a
	// program that may only read.
	AllowReadOnly bool
}

// Pool is an open pool and what opening it found out.
type Pool struct {
	*pgxpool.Pool
	// TransactionPooled: the connection string leads through a pooler in
	// transaction mode, so that nothing of a session outlasts a
	// transaction.
	TransactionPooled bool
}

// Conn is an open connection and what opening it found out.
type Conn struct {
	*pgx.Conn
	// TransactionPooled as Pool's.
	TransactionPooled bool
}

// Open opens a pool to connString after checking its sessions (see the
// package doc). Errors name o.Source and the server.
func Open(ctx context.Context, connString string, o Options) (*Pool, error) {
	pc, err := pgxpool.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("%s is not a valid PostgreSQL URL: %w", o.Source, err)
	}
	if o.MaxConns > 0 {
		pc.MaxConns = o.MaxConns
	}
	c := newChecker(pc.ConnConfig, connString, o)
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	if err := c.check(ctx); err != nil {
		return nil, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("connect to the database: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, c.connectError(ctx, err)
	}
	return &Pool{Pool: pool, TransactionPooled: c.pooled}, nil
}

// Connect opens one connection to connString after checking it as Open
// does.
func Connect(ctx context.Context, connString string, o Options) (*Conn, error) {
	cc, err := pgx.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("%s is not a valid PostgreSQL URL: %w", o.Source, err)
	}
	c := newChecker(cc, connString, o)
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	if err := c.check(ctx); err != nil {
		return nil, err
	}
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return nil, c.connectError(ctx, err)
	}
	return &Conn{Conn: conn, TransactionPooled: c.pooled}, nil
}

const isolationSetting = "default_transaction_isolation"

// checker checks a connection configuration and adjusts it: the
// isolation override where the server's default is stricter, exec mode
// behind a pooler in transaction mode.
type checker struct {
	cc      *pgx.ConnConfig
	o       Options
	timeout time.Duration
	carried string // the string's own session settings (pgsession.Carried)
	// urlSetsIsolation: the string sets default_transaction_isolation
	// (to read committed: ReadCommitted refuses another level).
	urlSetsIsolation bool
	// urlSetsExecMode: the string chooses pgx's default_query_exec_mode.
	urlSetsExecMode bool
	pooled          bool
}

func newChecker(cc *pgx.ConnConfig, connString string, o Options) *checker {
	c := &checker{cc: cc, o: o, timeout: o.Timeout, carried: pgsession.Carried(cc.RuntimeParams)}
	if c.timeout <= 0 {
		c.timeout = 10 * time.Second
	}
	_, c.urlSetsIsolation = pgsession.Setting(cc.RuntimeParams, isolationSetting)
	// pgx takes the parameter out of RuntimeParams; its name cannot
	// appear in a string that does not set it, but for a password or a
	// database so named, which then costs only the automatic exec mode.
	c.urlSetsExecMode = strings.Contains(connString, "default_query_exec_mode")
	if o.AppName != "" && (o.AppNameFixed || cc.RuntimeParams["application_name"] == "") {
		cc.RuntimeParams["application_name"] = o.AppName
	}
	return c
}

// check runs the start-up checks on connections of their own, which use
// the simple protocol: named prepared statements would collide behind a
// pooler in transaction mode before the check has found it.
func (c *checker) check(ctx context.Context) error {
	if err := pgsession.ReadCommitted(c.cc.RuntimeParams, c.o.Source); err != nil {
		return err
	}
	a, st, err := c.probe(ctx)
	if err != nil {
		return err
	}
	// Whichever probe connection is open when check returns.
	defer func() {
		if a != nil {
			closeQuietly(a)
		}
	}()
	if !readCommitted(st.Isolation) {
		if c.urlSetsIsolation {
			return c.isolationDropped(st.Isolation)
		}
		// Override the stricter default, and look again: a pooler may
		// refuse the parameter or drop it.
		c.cc.RuntimeParams[isolationSetting] = "read committed"
		closeQuietly(a)
		a = nil
		was := st.Isolation
		if a, st, err = c.probe(ctx); err != nil {
			var pe *pgconn.PgError
			if errors.As(err, &pe) && unsupportedStartupParameter(pe) == isolationSetting {
				return fmt.Errorf("the database's default isolation level for %s's sessions is %s, and the scheduler needs read committed "+
					"(its triggers read again after taking locks); the server at %s:%d refused the startup parameter that overrides it, "+
					"as a connection pooler (PgBouncer, say) does: set the default for the role on the database server, as that role: "+
					"ALTER ROLE CURRENT_USER SET default_transaction_isolation = 'read committed' "+
					"(or run that SET in PgBouncer's connect_query for the database), then have the pooler open new server connections "+
					"(PgBouncer: RECONNECT in its admin console): %w",
					c.o.Source, was, c.cc.Host, c.cc.Port, err)
			}
			return err
		}
		if !readCommitted(st.Isolation) {
			return c.isolationDropped(st.Isolation)
		}
	}
	if st.ReplicationRole != "origin" {
		return fmt.Errorf("sessions of %s at %s run with session_replication_role = %s (set in the URL, or for the role or the database): "+
			"triggers do not fire there, and the scheduler's must, or a message is stored with no head and never delivered; "+
			"remove the setting (ALTER ROLE CURRENT_USER RESET session_replication_role, as a superuser where it was set for the role)",
			c.o.Source, addr(a), st.ReplicationRole)
	}
	if st.ReadOnly && !c.o.AllowReadOnly {
		return fmt.Errorf("the database at %s takes no writes (transaction_read_only is on: a hot standby, or "+
			"default_transaction_read_only set for the role, the database or in %s), and the scheduler writes: "+
			"point %s at the primary, or list every server and add target_session_attrs=read-write "+
			"(README, \"High availability\")", addr(a), c.o.Source, c.o.Source)
	}
	if c.pooled, err = c.transactionPooled(ctx, a, st); err != nil {
		return err
	}
	if c.pooled && !c.urlSetsExecMode {
		// Named prepared statements stay on the server session that
		// prepared them; exec mode prepares none.
		c.cc.DefaultQueryExecMode = pgx.QueryExecModeExec
	}
	return nil
}

// probe connects with the simple protocol and reads the session's state.
func (c *checker) probe(ctx context.Context) (*pgx.Conn, queries.SessionStateRow, error) {
	cc := c.cc.Copy()
	cc.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return nil, queries.SessionStateRow{}, c.connectError(ctx, err)
	}
	st, err := queries.SessionState(ctx, conn)
	if err != nil {
		closeQuietly(conn)
		return nil, st, fmt.Errorf("read the session's state at %s: %w", addr(conn), err)
	}
	return conn, st, nil
}

// probeRounds bounds the rounds of transactionPooled's test.
const probeRounds = 8

// transactionPooled reports whether the connection string leads through
// a pooler in transaction (or statement) mode, where a's server session,
// on which it read st, is not a's alone.
//
// A connection whose server sees it at a's own address and port is
// direct. Otherwise a round of the test: a second client opens a
// transaction and a asks again. Directly or through a pooler in session
// mode each keeps a session of its own. In transaction mode the second
// client is handed a's idle server session (PgBouncer hands out the one
// freed last), or a is moved to another: either shows. Other clients of a
// busy pooler can take a's session in between and hide both, so the round
// is repeated; a direct connection or a session-mode pooler never shows
// either, so a pooler is never reported where there is none.
func (c *checker) transactionPooled(ctx context.Context, a *pgx.Conn, st queries.SessionStateRow) (bool, error) {
	if direct(a, st) {
		return false, nil
	}
	cc := c.cc.Copy()
	cc.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	b, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return false, c.connectError(ctx, err)
	}
	defer closeQuietly(b)
	pid := st.BackendPID
	for range probeRounds {
		tx, err := b.Begin(ctx)
		if err != nil {
			return false, fmt.Errorf("begin a transaction through %s at %s (a pooler in statement mode refuses transactions, "+
				"which the scheduler needs: use transaction or session mode): %w", c.o.Source, addr(b), err)
		}
		other, err := queries.SessionState(ctx, tx)
		// Ended before a asks again: a pooler of one server session would
		// make a wait for it.
		_ = tx.Rollback(ctx)
		if err != nil {
			return false, fmt.Errorf("read the session's state at %s: %w", addr(b), err)
		}
		again, err := queries.SessionState(ctx, a)
		if err != nil {
			return false, fmt.Errorf("read the session's state at %s: %w", addr(a), err)
		}
		if other.BackendPID == pid || again.BackendPID != pid {
			return true, nil
		}
	}
	return false, nil
}

// direct reports whether the server sees a at a's own end of the
// connection: no pooler between them.
func direct(a *pgx.Conn, st queries.SessionStateRow) bool {
	local, ok := a.PgConn().Conn().LocalAddr().(*net.TCPAddr)
	if !ok || st.ClientAddr == nil || st.ClientPort == nil {
		return false
	}
	seen := net.ParseIP(*st.ClientAddr)
	return seen != nil && seen.Equal(local.IP) && int(*st.ClientPort) == local.Port
}

func (c *checker) isolationDropped(level string) error {
	return fmt.Errorf("sessions of %s at %s:%d are %s, and the scheduler needs read committed (its triggers read again after taking locks): "+
		"the startup parameter default_transaction_isolation did not reach the server (a pooler dropping it: PgBouncer's ignore_startup_parameters?); "+
		"set the default for the role on the database server, as that role: ALTER ROLE CURRENT_USER SET default_transaction_isolation = 'read committed', "+
		"then have the pooler open new server connections (PgBouncer: RECONNECT in its admin console)",
		c.o.Source, c.cc.Host, c.cc.Port, level)
}

// connectError says why connecting failed, naming the server and, where
// it refused a setting of the connection string's, the string.
func (c *checker) connectError(ctx context.Context, err error) error {
	if errors.Is(err, context.DeadlineExceeded) && context.Cause(ctx) == context.DeadlineExceeded {
		// Something accepted the connection (or swallowed it) and never
		// answered: a hung server, a wrong port, a firewall. The bare
		// "context deadline exceeded" names neither server nor wait.
		return fmt.Errorf("the database at %s:%d did not answer within %v (is %s's host and port a PostgreSQL server that is up?): %w",
			c.cc.Host, c.cc.Port, c.timeout, c.o.Source, err)
	}
	if rerr := pgsession.Refused(err, c.o.Source, c.cc.Host, c.cc.Port, c.carried); rerr != nil {
		return rerr
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		if name := unsupportedStartupParameter(pe); name != "" && name != isolationSetting {
			return fmt.Errorf("the server at %s:%d refused the session setting %s of %s, as a connection pooler (PgBouncer, say) refuses "+
				"every startup parameter but a few: set it for the role on the database server instead (ALTER ROLE CURRENT_USER SET %s = ...), "+
				"or add it to PgBouncer's ignore_startup_parameters to have it dropped: %w",
				c.cc.Host, c.cc.Port, name, c.o.Source, name, err)
		}
	}
	return fmt.Errorf("connect to the database at %s:%d: %w", c.cc.Host, c.cc.Port, err)
}

// unsupportedStartupParameter returns the name of the startup parameter
// a pooler refused, as PgBouncer words it, or "".
func unsupportedStartupParameter(pe *pgconn.PgError) string {
	const prefix = "unsupported startup parameter: "
	if pe.Code != pgerrcode.ProtocolViolation || !strings.HasPrefix(pe.Message, prefix) {
		return ""
	}
	return strings.TrimSpace(strings.TrimPrefix(pe.Message, prefix))
}

// readCommitted reports whether level, as SHOW writes it, is READ
// COMMITTED; READ UNCOMMITTED is READ COMMITTED in PostgreSQL.
func readCommitted(level string) bool {
	return level == "read committed" || level == "read uncommitted"
}

func addr(conn *pgx.Conn) string {
	return conn.PgConn().Conn().RemoteAddr().String()
}

func closeQuietly(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	conn.Close(ctx)
}

// Writable reports whether a connection of pool takes writes, and the
// address of the server it reached, which need not be the URL's first
// when it lists several.
func Writable(ctx context.Context, pool *pgxpool.Pool) (server string, ok bool, err error) {
	c, err := pool.Acquire(ctx)
	if err != nil {
		return "", false, fmt.Errorf("connect to the database: %w", err)
	}
	defer c.Release()
	server = addr(c.Conn())
	st, err := queries.SessionState(ctx, c)
	if err != nil {
		return server, false, fmt.Errorf("read the session's state at %s: %w", server, err)
	}
	return server, !st.ReadOnly, nil
}

// ReconnectIfReadOnly closes every connection of pool when the server
// they reach takes no writes any more, and says so: a primary demoted in
// place (a switchover without a restart) keeps its sessions open and
// refuses every write on them, and pgx would replace them only at the end
// of their lifetime (an hour by default). New connections go where the
// connection string (named by source) leads now: the new primary, with a
// list of servers and target_session_attrs=read-write, or a name the
// failover moved.
func ReconnectIfReadOnly(ctx context.Context, pool *pgxpool.Pool, source string, logger *slog.Logger) error {
	server, ok, err := Writable(ctx, pool)
	if err != nil || ok {
		return err
	}
	pool.Reset()
	logger.Warn("the database takes no writes any more (a primary demoted in place?): closed every connection, to reconnect through "+source,
		"server", server)
	return fmt.Errorf("the database at %s takes no writes; reconnecting through %s", server, source)
}

// WatchWritable runs ReconnectIfReadOnly every interval until ctx is done,
// for a program with no readiness of its own to run it (the console).
func WatchWritable(ctx context.Context, pool *pgxpool.Pool, source string, interval time.Duration, logger *slog.Logger) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		cctx, cancel := context.WithTimeout(ctx, interval)
		if err := ReconnectIfReadOnly(cctx, pool, source, logger); err != nil && ctx.Err() == nil {
			logger.Debug("checking that the database takes writes", "error", err)
		}
		cancel()
	}
}
