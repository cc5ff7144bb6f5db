-- Business keys compare byte by byte (COLLATE "C"), whatever the
-- database's default collation.
--
-- A business key is an identifier, not prose: nothing reads it in
-- language order, and every comparison of two keys (an insert into
-- deferred_message_key_order or deferred_key_business_key, a lookup by
-- key, finalize's ORDER BY that orders the lock takers) went through the
-- database's collation. Under glibc's en_US.UTF-8, the default of the
-- official postgres image (compose.yaml) and of many managed servers, that
-- is strcoll for every comparison: inserting 100,000 messages with their
-- key heads took 2.6-2.9 s there against 1.4-1.6 s with this column
-- collation (docs/benchmarks.md, "Business keys in the C collation").
-- Under a "C" default nothing changes; under C.UTF-8 or an ICU default,
-- little but the order.
--
-- What operators see: ORDER BY business_key sorts by bytes (upper case
-- before lower case, 'order-10' before 'order-9'), the way Go compares
-- strings; and LIKE 'prefix%' on business_key can use the key
-- indexes, which it could not under a language collation.
--
-- Same type, another collation: the tables are not rewritten, but every
-- index on business_key is rebuilt, under a lock that blocks the three
-- tables' readers and writers meanwhile: 1.2 s for 1,000,000 pending
-- messages of 100,000 keys on the machine of docs/benchmarks.md.
ALTER TABLE deferred_message ALTER COLUMN business_key TYPE text COLLATE "C";
ALTER TABLE deferred_key ALTER COLUMN business_key TYPE text COLLATE "C";
ALTER TABLE deferred_inflight ALTER COLUMN business_key TYPE text COLLATE "C";
